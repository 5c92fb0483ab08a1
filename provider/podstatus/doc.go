// Package podstatus is what the node says of a pod: its PodStatus as a
// pure function of the VM's state (VMState, the record the pod worker
// keeps and persists), the pump that delivers each pod's newest status to
// the library in order without one slow pod holding up the others
// (StatusPump), and the writer that sends statuses to the API server
// (StatusWriter).
//
// podstatus knows nothing of the pod worker or the VMs (package provider
// owns them and calls in).
package podstatus
