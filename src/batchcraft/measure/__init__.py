"""Shared measurement helpers: timing with repeats, machine description, tables."""

from batchcraft.measure.timing import Measurement, measure
from batchcraft.measure.machine import cache_dir, cpu_model, machine_info
from batchcraft.measure.table import format_table

__all__ = ["Measurement", "measure", "machine_info", "cache_dir", "cpu_model", "format_table"]
