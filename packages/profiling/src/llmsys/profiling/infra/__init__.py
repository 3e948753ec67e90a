"""The profiling package's infrastructure, apart from its model and command lines.

- ``hardware``: datasheet numbers per GPU (``HARDWARE``, ``HardwareSpec``), each with its source.
- ``roofline``, ``collectives``, ``memory_model``: predicted op, collective and training-memory
  costs (``llmsys-roofline``).
- ``accounting``: FLOPs and bytes of a model step (MFU, tokens/s).
- ``roofline_check``: measured CSV rows set against those predictions.
- ``report``: results CSVs composed into one Markdown report (``llmsys-bench report``).

The results schema itself is ``llmsys.bench_harness.results``, shared by every package.
"""
