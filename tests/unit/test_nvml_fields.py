"""NVML field values read by their declared type, on nvidia-ml-py's own ctypes structs."""

from __future__ import annotations

import pytest

from trainspec.collector.samplers.nvml_fields import field_number

pynvml = pytest.importorskip("pynvml")


def _value(value_type: int, member: str, number, ret: int = 0):
    value = pynvml.c_nvmlFieldValue_t()
    value.nvmlReturn = ret
    value.valueType = value_type
    setattr(value.value, member, number)
    return value


def test_a_64_bit_counter_is_read_whole():
    total = 5 * 2**32 + 7  # an NVLink byte counter past 4 GiB
    v = _value(pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, "ullVal", total)
    assert v.value.uiVal == 7  # what a fixed 32-bit read returns
    assert field_number(pynvml, v) == total


@pytest.mark.parametrize(
    ("value_type", "member", "number"),
    [
        ("NVML_VALUE_TYPE_DOUBLE", "dVal", 312.25),
        ("NVML_VALUE_TYPE_UNSIGNED_INT", "uiVal", 251_000),  # milliwatts
        ("NVML_VALUE_TYPE_SIGNED_INT", "siVal", -3),
        ("NVML_VALUE_TYPE_SIGNED_LONG_LONG", "sllVal", -(2**40)),
        ("NVML_VALUE_TYPE_UNSIGNED_SHORT", "usVal", 65_535),
    ],
)
def test_each_type_reads_its_own_member(value_type, member, number):
    v = _value(getattr(pynvml, value_type), member, number)
    assert field_number(pynvml, v) == number


def test_a_field_the_driver_could_not_read_raises_its_own_code():
    v = _value(pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 1, ret=pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(pynvml.NVMLError) as raised:
        field_number(pynvml, v)
    assert raised.value.value == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_a_type_nvml_does_not_name_is_an_error_not_a_guess():
    v = _value(pynvml.NVML_VALUE_TYPE_COUNT, "ullVal", 1)
    with pytest.raises(pynvml.NVMLError):
        field_number(pynvml, v)
