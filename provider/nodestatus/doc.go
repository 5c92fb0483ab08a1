// Package nodestatus is the node side of the provider: the node object's
// capacity, allocatable, conditions, nodeInfo, labels and annotations as
// pure functions of the node's facts and host readings (Status), the
// status loop that pushes them (NodeStatus), the host readings themselves
// (memory, disk, load, KSM, retained disks), node.status.images and the
// image cache's garbage collection.
//
// nodestatus knows the node's configuration and packages qemu and oci; it
// knows nothing of pods or their VMs (package provider).
package nodestatus
