"""The `trainspec` command: one module per subcommand, registered in `main.COMMANDS`.

Each subcommand module exposes `configure(parser)` (adds its arguments) and
`run(args) -> int` (the exit code). Modules are imported only when their command runs, so
`trainspec validate` starts fast and works without torch.
"""
