"""The omni demo's client (`python -m examples.omni_demo.client`), inputs and a pipeline file
that deploys the installed model (`omnirail.models.omni_demo`)."""
