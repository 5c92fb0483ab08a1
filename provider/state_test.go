package provider

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
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/utils/ptr"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
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
	assert.False(t, retainOnDelete(pod(nil)))
	assert.False(t, retainOnDelete(pod(map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Delete"})))
	assert.False(t, retainOnDelete(pod(map[string]string{v1alpha1.StatePolicyAnnotation: "Retain"})), "state policy alone does not keep a deleted pod's disk")
	assert.True(t, retainOnDelete(pod(map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Retain"})))
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

	reason, _, err := prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Empty(t, reason, "first start: a fresh disk, nothing to say")
	write("5a")
	reason, msg, err := prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Equal(t, ReasonStateRestored, reason, msg)
	assert.True(t, read(ov, "5a"), "Retain: the disk is as the last run left it")

	// Disabled: the next start drops it.
	reason, _, err = prepareOverlay(ctx, v1alpha1.StatePolicyDisabled, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Empty(t, reason)
	assert.False(t, read(ov, "5a"), "Disabled: a fresh disk")
	assert.True(t, read(ov, "00"))

	// Retain over another image: fresh.
	write("5b")
	reason, msg, err = prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.NoError(t, err)
	assert.Equal(t, ReasonStateDiscarded, reason)
	assert.Contains(t, msg, baseB)
	assert.True(t, read(ov, "00"), "another image: a fresh disk")

	// A crash mid-create leaves only the .tmp, never a half-made disk at
	// the overlay's path; the next start replaces it.
	require.NoError(t, os.Remove(ov))
	require.NoError(t, os.WriteFile(ov+".tmp", []byte("half"), 0o600))
	_, _, err = prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.NoError(t, err)
	assert.True(t, read(ov, "00"))
	assert.NoFileExists(t, ov+".tmp")

	// An unreadable disk under Retain: refused, untouched.
	require.NoError(t, os.WriteFile(ov, []byte("not a qcow2 disk"), 0o600))
	_, _, err = prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseB, qemu.FormatRaw)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "cannot be read")
	b, _ := os.ReadFile(ov)
	assert.Equal(t, "not a qcow2 disk", string(b), "left as it was")
	_, _, err = prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, filepath.Join(dir, "missing.raw"), qemu.FormatRaw)
	require.Error(t, err)

	// Retain on delete: a standalone copy (no backing file), then the record.
	require.NoError(t, os.Remove(ov))
	_, _, err = prepareOverlay(ctx, v1alpha1.StatePolicyRetain, ov, baseA, qemu.FormatRaw)
	require.NoError(t, err)
	write("7c")
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "lab", Name: "rpi4-x", UID: "uid-1",
		Annotations:     map[string]string{v1alpha1.StatePolicyAnnotation: "Retain", v1alpha1.ReclaimPolicyAnnotation: "Retain"},
		OwnerReferences: []metav1.OwnerReference{{Kind: "ExporterSet", Name: "rpi4", Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Image: "reg/os:1"}}}}
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	st := podstatus.VMState{ImageDigest: "sha256:aa", ImageID: "reg/os@sha256:aa"}
	got, err := retainDisk(ctx, dir, podDir, pod, st, now)
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
	got, err = retainDisk(ctx, dir, podDir, pod, st, now)
	require.NoError(t, err)
	assert.Equal(t, want, got)
	assert.FileExists(t, filepath.Join(want, RetainedFileName))

	// A pod without a disk (kernel-only image) leaves nothing.
	pod2 := pod.DeepCopy()
	pod2.UID = "uid-2"
	got, err = retainDisk(ctx, dir, filepath.Join(dir, "vms", "uid-2"), pod2, st, now)
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
	_, err = retainDisk(ctx, dir, dir3, pod3, st, now)
	require.Error(t, err)
	assert.FileExists(t, filepath.Join(dir3, OverlayFileName), "the source is untouched")
}

// TestFlashDropsTheDisk: installing a flashed image removes the pod's disk
// before the flash is recorded, so even state policy Retain boots the new
// image from a fresh disk, and the record never names a flash whose old
// disk is still there.
func TestFlashDropsTheDisk(t *testing.T) {
	dir := t.TempDir()
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir})
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1",
		Annotations: map[string]string{v1alpha1.StatePolicyAnnotation: "Retain"}}}
	rec := newPodVM(pod.UID, filepath.Join(dir, "vms", "u1"), pod)
	require.NoError(t, os.MkdirAll(rec.dir, 0o700))
	ov := filepath.Join(rec.dir, OverlayFileName)
	require.NoError(t, os.WriteFile(ov, []byte("old disk"), 0o600))
	held := 0
	req := vmRequest{op: opFlash, image: &oci.Image{Ref: "reg/os:2", Digest: "sha256:bb"}, hold: func() { held++ }}
	require.NoError(t, p.installImage(rec, req))
	assert.NoFileExists(t, ov)
	var st podstatus.VMState
	b, err := os.ReadFile(filepath.Join(rec.dir, StatusFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &st))
	assert.Equal(t, "reg/os@sha256:bb", st.FlashedImage)
	assert.Zero(t, held, "the image hold became the pod's")

	// The old disk cannot be removed: nothing is recorded, the hold goes.
	require.NoError(t, os.Remove(filepath.Join(rec.dir, StatusFileName)))
	require.NoError(t, os.MkdirAll(filepath.Join(ov, "x"), 0o700)) // a non-empty directory where the disk is
	err = p.installImage(rec, vmRequest{op: opFlash, image: &oci.Image{Ref: "reg/os:3", Digest: "sha256:cc"}, hold: func() { held++ }})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "remove the old disk")
	assert.Equal(t, 1, held, "the refused request's image hold is released")
	assert.NoFileExists(t, filepath.Join(rec.dir, StatusFileName), "no flash recorded")
}

// TestReclaimDiskKeepsStateDirOnFailure: a disk that cannot be kept leaves
// the pod's state dir (the caller does not remove it) with the pod recorded
// as it was when deleted, reclaim annotation included, so the retry at the
// next agent start keeps the disk too; Delete lets the dir go.
func TestReclaimDiskKeepsStateDirOnFailure(t *testing.T) {
	dir := t.TempDir()
	p := NewVMs(context.Background(), VMsConfig{StateDir: dir, NodeName: "n"})
	bound := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u1"}}
	rec := newPodVM(bound.UID, filepath.Join(dir, "vms", "u1"), bound)
	require.NoError(t, os.MkdirAll(rec.dir, 0o700))
	require.NoError(t, writeJSONAtomic(filepath.Join(rec.dir, PodFileName), bound))
	require.NoError(t, os.WriteFile(filepath.Join(rec.dir, OverlayFileName), []byte("disk"), 0o600))

	assert.True(t, p.reclaimDisk(context.Background(), rec, bound), "Delete: the dir may go")

	// Annotated after binding; the retained area is blocked by a file.
	deleted := bound.DeepCopy()
	deleted.Annotations = map[string]string{v1alpha1.ReclaimPolicyAnnotation: "Retain"}
	require.NoError(t, os.WriteFile(filepath.Join(dir, nodestatus.RetainedDirName), []byte("not a directory"), 0o600))
	assert.False(t, p.reclaimDisk(context.Background(), rec, deleted), "the disk could not be kept: the dir stays")
	assert.FileExists(t, filepath.Join(rec.dir, OverlayFileName))
	var recorded corev1.Pod
	b, err := os.ReadFile(filepath.Join(rec.dir, PodFileName))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &recorded))
	assert.Equal(t, "Retain", recorded.Annotations[v1alpha1.ReclaimPolicyAnnotation], "a retry after a restart keeps the disk too")
}

// TestTranslateRetainWithSnapshotStart: a memory snapshot restores the
// guest with the image's disk, so state policy Retain and snapshot start
// are refused together; each alone is fine.
func TestTranslateRetainWithSnapshotStart(t *testing.T) {
	pod := func(ann map[string]string) *corev1.Pod {
		p := podFor("u", "img", corev1.RestartPolicyAlways, ann)
		p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(22)}}}
		return p
	}
	_, rej := podspec.Translate(pod(map[string]string{podspec.AnnotationStartFromSnapshot: "true", v1alpha1.StatePolicyAnnotation: "Retain"}), qemu.ArchX86_64)
	require.NotNil(t, rej)
	assert.Equal(t, podspec.ReasonUnsupportedPodSpec, rej.Reason)
	assert.Contains(t, rej.Message, "metadata.annotations[qemu-kubelet.io/state-policy]: Retain cannot be combined with qemu-kubelet.io/start-from-snapshot")
	for _, ann := range []map[string]string{
		{podspec.AnnotationStartFromSnapshot: "true", v1alpha1.StatePolicyAnnotation: "Disabled"},
		{podspec.AnnotationStartFromSnapshot: "false", v1alpha1.StatePolicyAnnotation: "Retain"},
	} {
		_, rej := podspec.Translate(pod(ann), qemu.ArchX86_64)
		assert.Nil(t, rej, "%v", ann)
	}
}
