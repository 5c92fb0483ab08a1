// Package provider is the virtual-kubelet provider of qemu-kubelet: it turns
// pods bound to a virtual node into QEMU VMs (via package qemu) booted from OS
// images (via package oci), reports pod status the way a kubelet does, and
// owns the node object: capacity, allocatable, conditions, nodeInfo, labels
// and the default taint.
//
// provider depends on qemu and oci; neither of them knows about Kubernetes.
package provider
