package controller

import (
	"context"

	corev1 "k8s.io/api/core/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// Lease is the lease state of one pod.
type Lease struct {
	// Leased is true while a client holds the pod.
	Leased bool
	// Holder names the client, when the source knows it.
	Holder string
	// Used is true once the pod has been leased since it was last recycled;
	// it outlives the lease, so a lease claimed and released between two
	// reconciles still retires the pod under the Replace policy.
	Used bool
}

// LeaseSource tells the controller which of a set's pods are leased and how
// many leases wait for a pod. The standalone source reads pod labels
// (LabelLeases); a Jumpstarter-backed source (Exporter status.leaseRef,
// pending Leases as demand) is the second implementation.
type LeaseSource interface {
	// Leases returns the lease state of each pod, keyed by pod name, and the
	// number of leases waiting for a pod of the set.
	Leases(ctx context.Context, set *v1alpha1.ExporterSet, pods []corev1.Pod) (map[string]Lease, int32, error)
}

// LabelLeases is the standalone lease source: a pod is leased while it
// carries v1alpha1.LeaseLabel and used once it carries v1alpha1.UsedLabel.
// It has no notion of pending leases.
type LabelLeases struct{}

// Leases implements LeaseSource from pod labels.
func (LabelLeases) Leases(_ context.Context, _ *v1alpha1.ExporterSet, pods []corev1.Pod) (map[string]Lease, int32, error) {
	out := make(map[string]Lease, len(pods))
	for i := range pods {
		holder, leased := pods[i].Labels[v1alpha1.LeaseLabel]
		_, used := pods[i].Labels[v1alpha1.UsedLabel]
		out[pods[i].Name] = Lease{Leased: leased, Holder: holder, Used: used}
	}
	return out, 0, nil
}
