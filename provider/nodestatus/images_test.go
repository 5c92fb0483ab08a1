package nodestatus

import (
	"fmt"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
)

func TestNodeImages(t *testing.T) {
	list := []oci.CachedImage{
		{Digest: "sha256:a", Names: []string{"r/a:1", "r/a@sha256:a"}, Size: 300},
		{Digest: "sha256:b", Size: 200},
		{Digest: "sha256:c", Names: []string{"r/c:1"}, Size: 100},
	}
	assert.Equal(t, []corev1.ContainerImage{
		{Names: []string{"r/a:1", "r/a@sha256:a"}, SizeBytes: 300},
		{Names: []string{"r/c:1"}, SizeBytes: 100},
	}, NodeImages(list))
	var many []oci.CachedImage
	for i := 0; i < 60; i++ {
		many = append(many, oci.CachedImage{Names: []string{fmt.Sprint(i)}, Size: int64(100 - i)})
	}
	assert.Len(t, NodeImages(many), MaxNodeImages)
	assert.Nil(t, NodeImages(nil))
}
