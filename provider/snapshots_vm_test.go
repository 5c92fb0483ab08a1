package provider

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/oci/ocitest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/podtest"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	"github.com/qemu-kubelet/qemu-kubelet/provider/vmtest"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// snapshotPod is a pod of the test image that starts from a snapshot: its
// readiness probe (the guest's HTTP server) is the ready point.
func snapshotPod(uid, ref string) *corev1.Pod {
	p := podFor(uid, ref, corev1.RestartPolicyAlways, map[string]string{podspec.AnnotationStartFromSnapshot: "true"})
	p.Spec.Containers[0].Resources.Limits = podtest.RL("cpu", "1", "memory", "128Mi")
	p.Spec.Containers[0].ReadinessProbe = &corev1.Probe{
		ProbeHandler:  corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/", Port: intstr.FromInt32(8080)}},
		PeriodSeconds: 1, TimeoutSeconds: 2, FailureThreshold: 3,
	}
	return p
}

func podReadyCond(p *corev1.Pod) bool { return running(p) && podstatus.Ready(p) }

// podVMOf returns the running VM of a pod (test helper).
func (h *harness) podVMOf(uid types.UID) VM {
	rec := h.rec(uid)
	require.NotNil(h.t, rec)
	vm := rec.vm.get()
	require.NotNil(h.t, vm)
	return vm
}

// waitEvent waits for an event containing all of want (events seen are
// kept in seen).
func waitEvent(t *testing.T, h *harness, seen *[]string, timeout time.Duration, want ...string) string {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		*seen = append(*seen, h.drainEvents()...)
		for _, e := range *seen {
			ok := true
			for _, w := range want {
				ok = ok && strings.Contains(e, w)
			}
			if ok {
				return e
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no event with %q within %s; events: %q", want, timeout, *seen)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func countEvents(seen []string, want string) int {
	n := 0
	for _, e := range seen {
		if strings.Contains(e, want) {
			n++
		}
	}
	return n
}

// TestSnapshotStart: the first pod boots and saves a memory snapshot at its
// ready point; the next pod of the same image and shape is restored from it
// (it never boots: no boot marker on its console) and is a working guest
// (console input echoed, HTTP through kubectl port-forward's path); a
// corrupt snapshot fails the restore, is discarded, the pod boots, and one
// of two pods starting at once saves a new snapshot (one creator).
func TestSnapshotStart(t *testing.T) {
	testutil.SkipIfShort(t, "boots VMs under QEMU")
	env := newVMEnv(t)
	refs, store, imageDir, stateDir := env.refs, env.store, env.imageDir, env.stateDir
	h := newHarness(t, stateDir, store, imageDir)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	var seen []string
	ref := refs[vmtest.VariantACPI]
	dirOf := func(uid string) string { return filepath.Join(stateDir, VMsDirName, uid) }

	// The snapshot is saved at Ready. The guest's HTTP server starts before
	// init prints the boot marker, so with an HTTP probe the snapshot may
	// hold a guest that has yet to print it (and a restored VM then does).
	// Here Ready is the guest agent answering an exec probe: init starts
	// the agent just before it prints the marker, so the saved guest has
	// printed it and a VM that prints it again has booted.
	agentReady := func(p *corev1.Pod) *corev1.Pod {
		p.Spec.Containers[0].ReadinessProbe.ProbeHandler = corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"cat", "/www/index.html"}}}
		return p
	}

	// 1. The creator boots, becomes Ready, and saves the snapshot.
	a := agentReady(snapshotPod("snap-a", ref))
	require.NoError(t, h.vms.CreatePod(ctx, a))
	h.wait(a.UID, 3*time.Minute, "Ready", podReadyCond)
	waitConsole(t, dirOf("snap-a"), vmtest.BootMarker, time.Second)
	waitEvent(t, h, &seen, 2*time.Minute, snapshot.ReasonSaved)
	img, err := store.Pull(ctx, ref, oci.PullOptions{Policy: oci.PullNever})
	require.NoError(t, err)
	sdir, err := store.AuxDir(img.Digest, snapshot.AuxName)
	require.NoError(t, err)
	ents, err := os.ReadDir(sdir)
	require.NoError(t, err)
	require.Len(t, ents, 1, "one published snapshot, no temp dirs left: %v", ents)
	kdir := filepath.Join(sdir, ents[0].Name())
	meta, ok := snapshot.Read(kdir)
	require.True(t, ok, "snapshot complete")
	assert.Equal(t, "default/vm-snap-a", meta.CreatedByPod)
	assert.Equal(t, 128, meta.MemoryMiB)
	assert.False(t, meta.Disk, "kernel + initrd image: no disk state")
	// The creator still works after its pause.
	con, err := h.podVMOf(a.UID).AttachConsole(ctx)
	require.NoError(t, err)
	_, err = con.Write([]byte("after-save\n"))
	require.NoError(t, err)
	testutil.ReadUntil(t, con, "QK-ECHO: after-save", 30*time.Second)
	con.Close()

	// 2. The next pod is restored, not booted, and works.
	b := agentReady(snapshotPod("snap-b", ref))
	require.NoError(t, h.vms.CreatePod(ctx, b))
	h.wait(b.UID, 2*time.Minute, "Ready", podReadyCond)
	waitEvent(t, h, &seen, 10*time.Second, "Started", "restored from a memory snapshot")
	con, err = h.podVMOf(b.UID).AttachConsole(ctx)
	require.NoError(t, err)
	_, err = con.Write([]byte("hello-restored\n"))
	require.NoError(t, err)
	testutil.ReadUntil(t, con, "QK-ECHO: hello-restored", 30*time.Second)
	con.Close()
	out, err := os.ReadFile(filepath.Join(dirOf("snap-b"), qemu.ConsoleLogName))
	require.NoError(t, err)
	assert.NotContains(t, string(out), vmtest.BootMarker, "a restored VM does not boot")
	s1, s2 := testutil.TCPPair(t)
	pf := make(chan error, 1)
	go func() { pf <- h.vms.PortForward(ctx, "default", b.Name, 8080, s1) }()
	_, err = s2.Write([]byte("GET / HTTP/1.0\r\n\r\n"))
	require.NoError(t, err)
	testutil.ReadUntil(t, bufio.NewReader(s2), "QK-HTTP-OK", 30*time.Second)
	s2.Close()
	select {
	case err := <-pf:
		assert.NoError(t, err)
	case <-time.After(30 * time.Second):
		t.Error("port-forward did not end when the client closed")
	}
	assert.Equal(t, 1, countEvents(h.drainEvents(), snapshot.ReasonSaved)+countEvents(seen, snapshot.ReasonSaved), "a restored VM saves no snapshot")
	for _, p := range []*corev1.Pod{a, b} {
		require.NoError(t, h.vms.DeletePod(ctx, deleting(p)))
	}

	// 3. A corrupt snapshot (same size, garbage): both pods starting at
	// once fall back to booting, the snapshot is discarded, and exactly one
	// of them saves a new one.
	statePath := filepath.Join(kdir, snapshot.StateFile)
	require.NoError(t, os.Chmod(statePath, 0o600))
	garbage := make([]byte, meta.StateBytes)
	for i := range garbage {
		garbage[i] = byte(i * 7)
	}
	require.NoError(t, os.WriteFile(statePath, garbage, 0o400))
	seen = nil
	c, d := snapshotPod("snap-c", ref), snapshotPod("snap-d", ref)
	require.NoError(t, h.vms.CreatePod(ctx, c))
	require.NoError(t, h.vms.CreatePod(ctx, d))
	h.wait(c.UID, 3*time.Minute, "Ready", podReadyCond)
	h.wait(d.UID, 3*time.Minute, "Ready", podReadyCond)
	waitEvent(t, h, &seen, 10*time.Second, snapshot.ReasonRestoreFailed, "discarded it, booting instead")
	waitEvent(t, h, &seen, 2*time.Minute, snapshot.ReasonSaved)
	waitConsole(t, dirOf("snap-c"), vmtest.BootMarker, time.Second)
	waitConsole(t, dirOf("snap-d"), vmtest.BootMarker, time.Second)
	time.Sleep(2 * time.Second) // a second creator would have saved by now
	seen = append(seen, h.drainEvents()...)
	assert.Equal(t, 1, countEvents(seen, snapshot.ReasonSaved), "one creator: %q", seen)
	m2, ok := snapshot.Read(kdir)
	require.True(t, ok, "a new snapshot replaced the corrupt one")
	assert.Contains(t, []string{"default/vm-snap-c", "default/vm-snap-d"}, m2.CreatedByPod)
	mb, _ := json.Marshal(m2)
	t.Logf("new snapshot: %s", mb)

	// 4. Its restore works.
	e := snapshotPod("snap-e", ref)
	require.NoError(t, h.vms.CreatePod(ctx, e))
	h.wait(e.UID, 2*time.Minute, "Ready", podReadyCond)
	waitEvent(t, h, &seen, 10*time.Second, "Started", "restored from a memory snapshot")
	for _, p := range []*corev1.Pod{c, d, e} {
		require.NoError(t, h.vms.DeletePod(ctx, deleting(p)))
	}
	for _, u := range []string{"snap-a", "snap-b", "snap-c", "snap-d", "snap-e"} {
		waitGoneDir(t, dirOf(u), 2*time.Minute)
	}
}

// BenchmarkSnapshotStart: pod create -> Ready (readiness probe on the
// guest's HTTP server, period 1 s) of a pod restored from a memory snapshot
// vs the same pod booted, alternating, 3 pairs per iteration, in the same
// run and on the same node (TCG, 1 vCPU, 128 MiB, kernel + initrd image,
// cached). The snapshot is saved once before the timer starts.
// x-of-baseline = restored median / booted median (goal <= 0.3).
func BenchmarkSnapshotStart(b *testing.B) {
	e := newBenchEnv(b)
	ctx := context.Background()
	var seen []string
	creator := snapshotPod("creator", e.ref)
	if err := e.h.vms.CreatePod(ctx, creator); err != nil {
		b.Fatal(err)
	}
	e.h.wait(creator.UID, 3*time.Minute, "Ready", podReadyCond)
	saved := waitEventB(b, e.h, &seen, 2*time.Minute, snapshot.ReasonSaved)
	b.Logf("creator: %s", saved)
	if err := e.h.vms.DeletePod(ctx, deleting(creator)); err != nil {
		b.Fatal(err)
	}
	toReady := func(p *corev1.Pod) time.Duration {
		start := time.Now()
		if err := e.h.vms.CreatePod(ctx, p); err != nil {
			b.Fatal(err)
		}
		e.h.wait(p.UID, 3*time.Minute, "Ready", podReadyCond)
		d := time.Since(start)
		if err := e.h.vms.DeletePod(ctx, deleting(p)); err != nil {
			b.Fatal(err)
		}
		waitGoneDir(b, filepath.Join(e.stateDir, VMsDirName, string(p.UID)), time.Minute)
		return d
	}
	var restored, booted []time.Duration
	n := 0
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := 0; j < 3; j++ {
			n++
			boot := snapshotPod(fmt.Sprintf("boot-%d", n), e.ref)
			delete(boot.Annotations, podspec.AnnotationStartFromSnapshot)
			if j%2 == 0 {
				booted = append(booted, toReady(boot))
			}
			restored = append(restored, toReady(snapshotPod(fmt.Sprintf("restore-%d", n), e.ref)))
			if j%2 == 1 {
				booted = append(booted, toReady(boot))
			}
		}
	}
	b.StopTimer()
	seen = append(seen, e.h.drainEvents()...)
	if r := countEvents(seen, "restored from a memory snapshot"); r != len(restored) {
		b.Fatalf("%d of %d snapshot pods were restored; events %q", r, len(restored), seen)
	}
	mr, mb := medianDur(restored), medianDur(booted)
	b.ReportMetric(float64(mr.Milliseconds()), "restored-ms")
	b.ReportMetric(float64(mb.Milliseconds()), "booted-ms")
	b.ReportMetric(float64(mr)/float64(mb), "x-of-baseline")
}

func waitEventB(b *testing.B, h *harness, seen *[]string, timeout time.Duration, want string) string {
	b.Helper()
	deadline := time.Now().Add(timeout)
	for {
		*seen = append(*seen, h.drainEvents()...)
		for _, e := range *seen {
			if strings.Contains(e, want) {
				return e
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("no event %q within %s; events %q", want, timeout, *seen)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestSnapshotStartDisk: an image that boots from its disk (SeaBIOS +
// SYSLINUX). The snapshot keeps the creator's overlay as it was at the
// save; a restored VM's overlay is backed by that copy (itself backed by the
// image's disk), and the guest works.
func TestSnapshotStartDisk(t *testing.T) {
	testutil.SkipIfShort(t, "boots VMs under QEMU")
	root := testutil.Searchable(t, t.TempDir())
	vmtest.ReapQEMU(t, root)
	reg := ocitest.StartRegistry(t, ocitest.RegistryOptions{})
	imgDir := vmtest.BuildTestImages(t)
	work := t.TempDir()
	require.NoError(t, os.Symlink(filepath.Join(imgDir, "disk.qcow2"), filepath.Join(work, "disk.qcow2")))
	ref := reg.Addr + "/" + vmtest.Repo + ":disk"
	pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Minute)
	ocitest.Run(pctx, t, work, ocitest.Oras(t), "push", "--plain-http", "--artifact-type", vmtest.ArtifactType, ref, "disk.qcow2")
	pcancel()
	imageDir := filepath.Join(root, "images")
	store, err := oci.Open(imageDir, oci.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { store.Close() })
	stateDir := filepath.Join(root, "state")
	// As vmUser 107 (a root agent's default): the snapshot is saved
	// through a socket handed to that user, and the restored VMs' overlays
	// back onto the snapshot's disk copy in the image cache.
	vmUserDirs(t, stateDir)
	h := newHarnessWith(t, stateDir, store, imageDir, func(c *VMsConfig) { c.VMUser = &qemu.User{UID: 107, GID: 107} })
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	var seen []string

	a := snapshotPod("disk-a", ref)
	require.NoError(t, h.vms.CreatePod(ctx, a))
	h.wait(a.UID, 4*time.Minute, "Ready", podReadyCond)
	waitEvent(t, h, &seen, 2*time.Minute, snapshot.ReasonSaved)
	img, err := store.Pull(ctx, ref, oci.PullOptions{Policy: oci.PullNever})
	require.NoError(t, err)
	sdir, err := store.AuxDir(img.Digest, snapshot.AuxName)
	require.NoError(t, err)
	ents, err := os.ReadDir(sdir)
	require.NoError(t, err)
	require.Len(t, ents, 1)
	kdir := filepath.Join(sdir, ents[0].Name())
	meta, ok := snapshot.Read(kdir)
	require.True(t, ok)
	assert.True(t, meta.Disk, "the overlay copy is part of the snapshot")
	info, err := qemu.InspectImage(ctx, filepath.Join(kdir, snapshot.DiskFile))
	require.NoError(t, err)
	assert.Equal(t, img.Disk, info.BackingFile, "the snapshot's disk is an overlay over the image's")

	b := snapshotPod("disk-b", ref)
	require.NoError(t, h.vms.CreatePod(ctx, b))
	h.wait(b.UID, 2*time.Minute, "Ready", podReadyCond)
	waitEvent(t, h, &seen, 10*time.Second, "Started", "restored from a memory snapshot")
	info, err = qemu.InspectImage(ctx, filepath.Join(stateDir, VMsDirName, "disk-b", OverlayFileName))
	require.NoError(t, err)
	assert.Equal(t, filepath.Join(kdir, snapshot.DiskFile), info.BackingFile, "the restored VM's overlay is over the snapshot's disk")
	con, err := h.podVMOf(b.UID).AttachConsole(ctx)
	require.NoError(t, err)
	_, err = con.Write([]byte("hello-disk\n"))
	require.NoError(t, err)
	testutil.ReadUntil(t, con, "QK-ECHO: hello-disk", 30*time.Second)
	con.Close()
	for _, p := range []*corev1.Pod{a, b} {
		require.NoError(t, h.vms.DeletePod(ctx, deleting(p)))
	}
	for _, u := range []string{"disk-a", "disk-b"} {
		waitGoneDir(t, filepath.Join(stateDir, VMsDirName, u), 2*time.Minute)
	}
}
