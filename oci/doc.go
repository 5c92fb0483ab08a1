// Package oci owns OS images stored as OCI artifacts: it resolves a reference,
// pulls and verifies the content with the containerd libraries, unpacks it
// defensively into a content-addressed cache shared by all VMs on the host,
// and hands out local files with roles (kernel, initrd, disk).
//
// It knows nothing about Kubernetes or QEMU.
package oci
