// Package podspec turns a pod into what its VM needs, as pure functions
// over plain data: the pod's translation into a Plan (Translate) and its
// admission against the node (Admit), the guest's configuration disks
// (volumes, env), the kernel command line, and the holds of pods that
// need a disabled feature (DecideHold).
//
// podspec knows the pod and package qemu's and oci's types; it knows
// nothing of the pod's worker, its VM or its status (package provider
// runs them).
package podspec
