"""What connects an engine to the tools around it: trainers' callbacks, traces and metrics.

    from offload.integrations.hf import OffloadCallback         # transformers.Trainer: pip install 'offload[hf]'
    from offload.integrations.lightning import OffloadCallback  # lightning.Trainer:    pip install 'offload[lightning]'
    from offload.integrations.otel import StepTracer            # OpenTelemetry spans:  pip install 'offload[otel]'
    from offload.integrations.prometheus import PrometheusExporter  # Prometheus:  pip install 'offload[metrics]'

Each submodule imports its own framework; importing this package imports none. A loop one owns
(plain PyTorch, or ``accelerate``) needs no callback: put the forward under ``with eng:``.
"""
