"""One NVML field value (`nvmlDeviceGetFieldValues`) as a number.

Each value carries its own return code and a `valueType` that names which member of the
value union the driver filled (NVML's `nvmlValueType_t`): reading a fixed member instead
would return the low half of a 64-bit counter, or the bits of a double as an integer, for a
field whose type is not the one assumed.
"""

from __future__ import annotations

from typing import Any

# nvmlValueType_t -> the c_nvmlValue_t member that holds it (nvml.h).
_MEMBERS = {
    0: "dVal",  # NVML_VALUE_TYPE_DOUBLE
    1: "uiVal",  # NVML_VALUE_TYPE_UNSIGNED_INT
    2: "ulVal",  # NVML_VALUE_TYPE_UNSIGNED_LONG
    3: "ullVal",  # NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    4: "sllVal",  # NVML_VALUE_TYPE_SIGNED_LONG_LONG
    5: "siVal",  # NVML_VALUE_TYPE_SIGNED_INT
    6: "usVal",  # NVML_VALUE_TYPE_UNSIGNED_SHORT
}
_ERROR_UNKNOWN = 999  # NVML_ERROR_UNKNOWN


def field_number(nv: Any, value: Any) -> int | float:
    """The value's number (an int for the integer types); raises `nv.NVMLError` with the
    field's own return code when the driver could not read it, or for a type it does not
    name."""
    if value.nvmlReturn != nv.NVML_SUCCESS:
        raise nv.NVMLError(value.nvmlReturn)
    member = _MEMBERS.get(int(value.valueType))
    if member is None:
        raise nv.NVMLError(getattr(nv, "NVML_ERROR_UNKNOWN", _ERROR_UNKNOWN))
    return getattr(value.value, member)
