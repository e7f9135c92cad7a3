"""What runtimes and exporters share: the verify-graph layout (``io``), the ONNX export manifest
(``manifest``), the TensorRT engine manifest (``engines``) and its optimisation profiles
(``profiles``). Both ``backends/`` and ``exporters/`` import from here and never from each
other's direction backwards: exporters may run runtimes (parity checks), runtimes never import
exporters (export on first use goes through the ``EXPORTERS`` registry).
"""
