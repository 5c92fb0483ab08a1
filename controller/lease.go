package controller

import (
	"context"
	"fmt"
	"time"

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
	// Expires, when not zero, is when the lease ends: from then on the
	// controller treats the pod as released.
	Expires time.Time
	// ExpiryErr says why a lease's expiry could not be read; such a lease
	// does not expire (nothing is deleted on bad input).
	ExpiryErr error
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
// carries v1alpha1.LeaseLabel and used once it carries v1alpha1.UsedLabel;
// its lease ends at v1alpha1.LeaseExpiresAnnotation when set. It has no
// notion of pending leases.
type LabelLeases struct{}

// Leases implements LeaseSource from pod labels.
func (LabelLeases) Leases(_ context.Context, _ *v1alpha1.ExporterSet, pods []corev1.Pod) (map[string]Lease, int32, error) {
	out := make(map[string]Lease, len(pods))
	for i := range pods {
		holder, leased := pods[i].Labels[v1alpha1.LeaseLabel]
		_, used := pods[i].Labels[v1alpha1.UsedLabel]
		l := Lease{Leased: leased, Holder: holder, Used: used}
		if v, ok := pods[i].Annotations[v1alpha1.LeaseExpiresAnnotation]; ok && leased {
			l.Expires, l.ExpiryErr = ParseLeaseExpiry(v)
		}
		out[pods[i].Name] = l
	}
	return out, 0, nil
}

// ParseLeaseExpiry parses the value of v1alpha1.LeaseExpiresAnnotation
// (RFC 3339).
func ParseLeaseExpiry(v string) (time.Time, error) {
	t, err := time.Parse(time.RFC3339, v)
	if err != nil {
		return time.Time{}, fmt.Errorf("annotation %s=%q is not an RFC 3339 time (e.g. 2026-01-02T15:04:05Z): the lease does not expire", v1alpha1.LeaseExpiresAnnotation, v)
	}
	return t, nil
}
