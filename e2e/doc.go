// Package e2e holds end-to-end tests that run qemu-kubelet and the
// exporterset-controller against a real control plane (package e2e/cluster),
// real QEMU and a real OCI registry.
package e2e
