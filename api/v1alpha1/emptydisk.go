package v1alpha1

// EmptyDiskImage, as a VM pod's container image, boots an empty root disk
// instead of an OS image: a sparse qcow2 of the container's
// ephemeral-storage limit (else its request) under the firmware, for a
// Jumpstarter lease holder to flash (upstream Jumpstarter's model of a
// virtual target). Nothing is pulled for it. docs/pods.md, "A VM with no
// OS image".
const EmptyDiskImage = "qemu-kubelet.io/empty-disk"
