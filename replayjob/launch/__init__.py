"""Fan-out of an ablation: the spec, container commands, Kubernetes Jobs, the Argo workflow, submission."""
