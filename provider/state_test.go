package provider

import (
	"context"
	"encoding/json"
	"github.com/qemu-kubelet/qemu-kubelet/provider/exporter"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
)

// TestFlashDropsTheDisk: installing a flashed image removes the pod's disk
// before the flash is recorded, so even state policy Retain boots the new
// image from a fresh disk, and the record never names a flash whose old
// disk is still there.
func TestFlashDropsTheDisk(t *testing.T) {
	dir := t.TempDir()
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir})
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1",
		Annotations: map[string]string{v1alpha1.StatePolicyAnnotation: "Retain"}}}
	run := p.newRun(pod)
	rec := run.rec
	require.NoError(t, os.MkdirAll(rec.dir, 0o700))
	ov := filepath.Join(rec.dir, OverlayFileName)
	require.NoError(t, os.WriteFile(ov, []byte("old disk"), 0o600))
	held := 0
	f := &exporter.Flash{Image: &oci.Image{Ref: "reg/os:2", Digest: "sha256:bb"}, Hold: func() { held++ }}
	require.NoError(t, run.installFlash(f))
	assert.NoFileExists(t, ov)
	var st podstatus.VMState
	b, err := os.ReadFile(filepath.Join(rec.dir, StatusFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &st))
	assert.Equal(t, "reg/os@sha256:bb", st.FlashedImage)
	assert.Zero(t, held, "the image hold became the pod's")

	// The old disk cannot be set aside (a non-empty directory where it
	// would go): nothing is recorded, the disk stays, the hold goes.
	require.NoError(t, os.Remove(filepath.Join(rec.dir, StatusFileName)))
	require.NoError(t, os.WriteFile(ov, []byte("second disk"), 0o600))
	require.NoError(t, os.MkdirAll(filepath.Join(ov+".pre-flash", "x"), 0o700))
	err = run.installFlash(&exporter.Flash{Image: &oci.Image{Ref: "reg/os:3", Digest: "sha256:cc"}, Hold: func() { held++ }})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "set the old disk aside")
	assert.Equal(t, 1, held, "the refused request's image hold is released")
	assert.NoFileExists(t, filepath.Join(rec.dir, StatusFileName), "no flash recorded")
	b, err = os.ReadFile(ov)
	require.NoError(t, err)
	assert.Equal(t, "second disk", string(b), "the disk is as it was")
}

// TestReclaimDiskKeepsStateDirOnFailure: a disk that cannot be kept leaves
// the pod's state dir (the caller does not remove it) with the pod recorded
// as it was when deleted, reclaim annotation included, so the retry at the
// next agent start keeps the disk too; Delete lets the dir go.
func TestReclaimDiskKeepsStateDirOnFailure(t *testing.T) {
	dir := t.TempDir()
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, NodeName: "n"})
	bound := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1"}}
	run := p.newRun(bound)
	rec := run.rec
	require.NoError(t, os.MkdirAll(rec.dir, 0o700))
	require.NoError(t, atomicfile.WriteJSON(filepath.Join(rec.dir, PodFileName), bound))
	require.NoError(t, os.WriteFile(filepath.Join(rec.dir, OverlayFileName), []byte("disk"), 0o600))

	assert.True(t, run.reclaimDisk(context.Background(), bound), "Delete: the dir may go")

	// Annotated after binding; the retained area is blocked by a file.
	deleted := bound.DeepCopy()
	deleted.Annotations = map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Retain"}
	require.NoError(t, os.WriteFile(filepath.Join(dir, nodestatus.RetainedDirName), []byte("not a directory"), 0o600))
	assert.False(t, run.reclaimDisk(context.Background(), deleted), "the disk could not be kept: the dir stays")
	assert.FileExists(t, filepath.Join(rec.dir, OverlayFileName))
	var recorded corev1.Pod
	b, err := os.ReadFile(filepath.Join(rec.dir, PodFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &recorded))
	assert.Equal(t, "Retain", recorded.Annotations[v1alpha1.ReclaimPolicyAnnotation], "a retry after a restart keeps the disk too")
}
