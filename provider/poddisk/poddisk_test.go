package poddisk

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
)

func TestDecideOverlay(t *testing.T) {
	const base = "/state/images/sha256-a/disk.qcow2"
	for _, tc := range []struct {
		name   string
		policy v1alpha1.StatePolicy
		found  overlayFound
		want   overlayAction
		why    string
	}{
		{"Disabled, none", v1alpha1.StatePolicyDisabled, overlayFound{}, overlayCreate, ""},
		{"unset is Disabled, none", "", overlayFound{}, overlayCreate, ""},
		{"Disabled replaces the last run's", v1alpha1.StatePolicyDisabled, overlayFound{Exists: true, Backing: base}, overlayReplace, "fresh disk"},
		{"unset replaces the last run's", "", overlayFound{Exists: true, Backing: base}, overlayReplace, "fresh disk"},
		{"Disabled replaces an unreadable one", v1alpha1.StatePolicyDisabled, overlayFound{Exists: true, Err: "bad header"}, overlayReplace, "fresh disk"},
		{"Retain, none", v1alpha1.StatePolicyRetain, overlayFound{}, overlayCreate, ""},
		{"Retain keeps the disk over the same image", v1alpha1.StatePolicyRetain, overlayFound{Exists: true, Backing: base}, overlayReuse, "as the last run left it"},
		{"Retain, another image (flash, new digest)", v1alpha1.StatePolicyRetain, overlayFound{Exists: true, Backing: "/state/images/sha256-b/disk.qcow2"}, overlayReplace, "was over /state/images/sha256-b/disk.qcow2"},
		{"Retain, no backing file recorded", v1alpha1.StatePolicyRetain, overlayFound{Exists: true}, overlayReplace, "was over no image"},
		{"Retain never touches an unreadable disk", v1alpha1.StatePolicyRetain, overlayFound{Exists: true, Err: "bad header"}, overlayRefuse, "cannot be read (bad header); it is left untouched"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			act, why := decideOverlay(tc.policy, tc.found, base)
			assert.Equal(t, tc.want, act)
			if tc.why == "" {
				assert.Empty(t, why)
			} else {
				assert.Contains(t, why, tc.why)
			}
		})
	}
}

func TestPolicyAnnotations(t *testing.T) {
	pod := func(ann map[string]string) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Annotations: ann}}
	}
	assert.Equal(t, v1alpha1.StatePolicyDisabled, StatePolicyOf(pod(nil)))
	assert.Equal(t, v1alpha1.StatePolicyDisabled, StatePolicyOf(pod(map[string]string{v1alpha1.StatePolicyAnnotation: "Disabled"})))
	assert.Equal(t, v1alpha1.StatePolicyRetain, StatePolicyOf(pod(map[string]string{v1alpha1.StatePolicyAnnotation: "Retain"})))
	assert.False(t, RetainOnDelete(pod(nil)))
	assert.False(t, RetainOnDelete(pod(map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Delete"})))
	assert.False(t, RetainOnDelete(pod(map[string]string{v1alpha1.StatePolicyAnnotation: "Retain"})), "state policy alone does not keep a deleted pod's disk")
	assert.True(t, RetainOnDelete(pod(map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Retain"})))
}

// TestOverlayAndRetainWithQemuImg runs the executors on real qcow2 files
// (qemu-img): a Retain start keeps the disk's content, a Disabled start and
// an image change drop it, an unreadable disk is refused and left as it
// was, a half-made overlay (a crash mid-create) is never taken for the
// disk, and a retained disk is a standalone copy written before its record.
func TestOverlayAndRetainWithQemuImg(t *testing.T) {
	testutil.SkipIfShort(t, "qemu-img")
	ctx := context.Background()
	dir := t.TempDir()
	baseA := filepath.Join(dir, "a.raw")
	baseB := filepath.Join(dir, "b.raw")
	for _, b := range []string{baseA, baseB} {
		require.NoError(t, os.WriteFile(b, make([]byte, 1<<20), 0o600))
	}
	podDir := filepath.Join(dir, "vms", "uid-1")
	require.NoError(t, os.MkdirAll(podDir, 0o700))
	ov := filepath.Join(podDir, OverlayFileName)

	// The guest's write, as QEMU would do it: into the overlay.
	write := func(s string) {
		t.Helper()
		out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "write -P 0x"+s+" 4096 512", ov).CombinedOutput()
		require.NoError(t, err, "%s", out)
	}
	// read tells whether the overlay's sector at 4096 holds pattern s.
	read := func(path, s string) bool {
		t.Helper()
		out, err := exec.Command("qemu-io", "-f", "qcow2", "-c", "read -P 0x"+s+" 4096 512", path).CombinedOutput()
		if strings.Contains(string(out), "Pattern verification failed") {
			return false
		}
		require.NoError(t, err, "%s", out)
		return true
	}

	reason, _, err := Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Empty(t, reason, "first start: a fresh disk, nothing to say")
	write("5a")
	reason, msg, err := Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Equal(t, ReasonStateRestored, reason, msg)
	assert.True(t, read(ov, "5a"), "Retain: the disk is as the last run left it")

	// Disabled: the next start drops it.
	reason, _, err = Prepare(ctx, v1alpha1.StatePolicyDisabled, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Empty(t, reason)
	assert.False(t, read(ov, "5a"), "Disabled: a fresh disk")
	assert.True(t, read(ov, "00"))

	// Retain over another image: fresh.
	write("5b")
	reason, msg, err = Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Equal(t, ReasonStateDiscarded, reason)
	assert.Contains(t, msg, baseB)
	assert.True(t, read(ov, "00"), "another image: a fresh disk")

	// A crash mid-create leaves only the .tmp, never a half-made disk at
	// the overlay's path; the next start replaces it.
	require.NoError(t, os.Remove(ov))
	require.NoError(t, os.WriteFile(ov+".tmp", []byte("half"), 0o600))
	_, _, err = Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.NoError(t, err)
	assert.True(t, read(ov, "00"))
	assert.NoFileExists(t, ov+".tmp")

	// An unreadable disk under Retain: refused, untouched.
	require.NoError(t, os.WriteFile(ov, []byte("not a qcow2 disk"), 0o600))
	_, _, err = Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot be read")
	b, _ := os.ReadFile(ov)
	assert.Equal(t, "not a qcow2 disk", string(b), "left as it was")
	_, _, err = Prepare(ctx, v1alpha1.StatePolicyRetain, ov, filepath.Join(dir, "missing.raw"), qemu.FormatRaw)
	require.Error(t, err)

	// Retain on delete: a standalone copy (no backing file), then the record.
	require.NoError(t, os.Remove(ov))
	_, _, err = Prepare(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	write("7c")
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "rpi4-x", UID: "uid-1",
		Annotations:     map[string]string{v1alpha1.StatePolicyAnnotation: "Retain", v1alpha1.ReclaimPolicyAnnotation: "Retain"},
		OwnerReferences: []metav1.OwnerReference{{Kind: "ExporterSet", Name: "rpi4", Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Image: "reg/os:1"}}}}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	st := podstatus.VMState{ImageDigest: "sha256:aa", ImageID: "reg/os@sha256:aa"}
	got, err := Retain(ctx, dir, podDir, pod, st.ImageID, st.ImageDigest, now)
	require.NoError(t, err)
	want := filepath.Join(dir, nodestatus.RetainedDirName, "lab_rpi4-x_uid-1")
	assert.Equal(t, want, got)
	info, err := qemu.InspectImage(ctx, filepath.Join(want, OverlayFileName))
	require.NoError(t, err)
	assert.Empty(t, info.BackingFile, "standalone: needs no image")
	require.NoError(t, os.Remove(baseA)) // the image may be garbage-collected
	assert.True(t, read(filepath.Join(want, OverlayFileName), "7c"), "the guest's write is in the kept disk")
	var rd RetainedDisk
	b, err = os.ReadFile(filepath.Join(want, RetainedFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &rd))
	assert.Equal(t, RetainedDisk{Namespace: "lab", Name: "rpi4-x", UID: "uid-1", Owner: "ExporterSet/rpi4", Image: "reg/os@sha256:aa",
		ImageDigest: "sha256:aa", StatePolicy: "Retain", Disk: OverlayFileName, RetainedAt: now}, rd)
	n, err := nodestatus.RetainedBytes(dir)
	require.NoError(t, err)
	assert.Greater(t, n, int64(512))

	// Idempotent: an interrupted earlier call (disk copied, no record yet;
	// the source already gone) completes with the record alone.
	require.NoError(t, os.Remove(filepath.Join(want, RetainedFileName)))
	require.NoError(t, os.Remove(ov))
	got, err = Retain(ctx, dir, podDir, pod, st.ImageID, st.ImageDigest, now)
	require.NoError(t, err)
	assert.Equal(t, want, got)
	assert.FileExists(t, filepath.Join(want, RetainedFileName))

	// A pod without a disk (kernel-only image) leaves nothing.
	pod2 := pod.DeepCopy()
	pod2.UID = "uid-2"
	got, err = Retain(ctx, dir, filepath.Join(dir, "vms", "uid-2"), pod2, st.ImageID, st.ImageDigest, now)
	require.NoError(t, err)
	assert.Empty(t, got)
	assert.NoDirExists(t, filepath.Join(dir, nodestatus.RetainedDirName, "lab_rpi4-x_uid-2"))

	// A copy that cannot be written fails and writes no record (the
	// caller then keeps the pod's state dir).
	pod3 := pod.DeepCopy()
	pod3.UID = "uid-3"
	dir3 := filepath.Join(dir, "vms", "uid-3")
	require.NoError(t, os.MkdirAll(dir3, 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir3, OverlayFileName), []byte("x"), 0o600))
	blocked := filepath.Join(dir, nodestatus.RetainedDirName, "lab_rpi4-x_uid-3")
	require.NoError(t, os.WriteFile(blocked, []byte("a file where the directory goes"), 0o600))
	_, err = Retain(ctx, dir, dir3, pod3, st.ImageID, st.ImageDigest, now)
	require.Error(t, err)
	assert.FileExists(t, filepath.Join(dir3, OverlayFileName), "the source is untouched")
}
