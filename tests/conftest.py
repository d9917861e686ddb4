"""Shared pytest settings: nothing here reaches the network beyond loopback."""
