package provider

import (
	"context"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	corev1 "k8s.io/api/core/v1"
)

// ImageStore is what the pods' workers need of the node's image cache
// (*oci.Store, passed in by cmd; fakes in the fast worker tests).
type ImageStore interface {
	// Pull resolves ref and pulls it into the cache (with policy PullNever:
	// only what is cached, no registry).
	Pull(ctx context.Context, ref string, opts oci.PullOptions) (*oci.Image, error)
	// Acquire holds the image of digest dgst against GC until release.
	Acquire(dgst string) (release func(), err error)
	// AuxDir is a directory kept with the image of dgst (memory snapshots).
	AuxDir(dgst, name string) (string, error)
}

var _ ImageStore = (*oci.Store)(nil)

// MaxNodeImages caps node.status.images, as the kubelet's
// nodeStatusMaxImages (50) does.
const MaxNodeImages = 50

// NodeImages turns the image cache listing (largest first) into
// node.status.images, so the scheduler's ImageLocality prefers nodes that
// already hold an image. Images without a name are left out. Pure.
func NodeImages(list []oci.CachedImage) []corev1.ContainerImage {
	var out []corev1.ContainerImage
	for _, im := range list {
		if len(im.Names) == 0 {
			continue
		}
		out = append(out, corev1.ContainerImage{Names: append([]string(nil), im.Names...), SizeBytes: im.Size})
		if len(out) == MaxNodeImages {
			break
		}
	}
	return out
}
