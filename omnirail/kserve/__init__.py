"""Generated stubs of the Open Inference Protocol (KServe v2) gRPC service (package
`inference`), from protos/omnirail/kserve/ by scripts/gen_protos.sh; do not edit."""
