"""The mesh transport: gRPC servers and the long-lived channels stages and the coordinator
open to each other."""
