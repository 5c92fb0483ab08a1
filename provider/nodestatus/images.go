package nodestatus

import (
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	corev1 "k8s.io/api/core/v1"
)

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
