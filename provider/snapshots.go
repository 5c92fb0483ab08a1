package provider

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/provider/snapshot"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// The pod worker's side of cold start from a memory snapshot
// (podspec.AnnotationStartFromSnapshot; keys, store and files are package
// snapshot's): how a run starts (prepareSnapshotStart), the save at
// readiness (saveSnapshot), a claim a run did not use
// (dropSnapshotClaim) and a restore QEMU could not do (restoreFailed).
// The run's claim and use are on the pod record (podVM.snap), the worker
// goroutine's alone: every function here runs on it.

// prepareSnapshotStart decides how a run of a snapshot-start pod starts
// and adjusts spec (snapshot.Store.Prepare); it returns the overlay base
// of a restore ("" for the image's). Worker goroutine only. Problems are
// events, never errors: the VM then boots.
func (r *podRun) prepareSnapshotStart(ctx context.Context, pod *corev1.Pod, plan podspec.Plan, img *oci.Image, spec *qemu.Spec) (overlayBase string) {
	p, rec := r.node, r.rec
	if !plan.SnapshotStart {
		return ""
	}
	st, err := p.snaps.Prepare(ctx, p.cfg.Images, snapshot.Request{
		UID: rec.uid, Pod: pod.Namespace + "/" + pod.Name, ImageDigest: img.Digest, ImageDisk: img.Disk != "",
		AfterFailedRestore: rec.snap.restoreFailed,
	}, spec)
	if err != nil {
		klog.FromContext(ctx).Info("Snapshot start skipped", "err", err)
		p.event(pod, corev1.EventTypeWarning, snapshot.ReasonSkipped, "Booting instead of starting from a memory snapshot: "+err.Error())
		return ""
	}
	if st.Use != nil {
		rec.snap.used = st.Use
	}
	if st.Claim != nil {
		rec.snap.claim = st.Claim
	}
	return st.Overlay
}

// dropSnapshotClaim releases a claim the run did not use (it ended before
// readiness, or the pod goes).
func (r *podRun) dropSnapshotClaim() {
	p, rec := r.node, r.rec
	c := rec.snap.claim
	rec.snap.claim = nil
	p.snaps.Release(c)
}

// saveSnapshot saves the snapshot the run owes, now that it is ready
// (its first Ready: the worker's actSaveSnapshot), and releases its claim;
// no claim, nothing. The guest is paused while its memory is written; the
// worker, which alone acts on the VM, waits for it. A failure is an event:
// the VM runs on.
func (r *podRun) saveSnapshot(ctx context.Context, vm VM) {
	p, rec := r.node, r.rec
	c := rec.snap.claim
	rec.snap.claim = nil
	if c == nil {
		return
	}
	pod := rec.podCopy()
	defer p.snaps.Release(c)
	log := klog.FromContext(ctx)
	m, err := p.snaps.Save(ctx, vm, c, filepath.Join(rec.dir, OverlayFileName))
	if err != nil {
		log.Error(err, "Save memory snapshot")
		p.event(pod, corev1.EventTypeWarning, snapshot.ReasonFailed, fmt.Sprintf("Saving a memory snapshot of the VM failed (it runs on): %v", err))
		return
	}
	log.Info("Memory snapshot saved", "key", m.Key, "bytes", m.StateBytes, "pausedMs", m.PausedMillis)
	p.event(pod, corev1.EventTypeNormal, snapshot.ReasonSaved, fmt.Sprintf(
		"Saved a memory snapshot of the VM at its ready point (%d MiB, guest paused %d ms); pods of the same image and VM shape start from it (key %s)",
		m.StateBytes>>20, m.PausedMillis, m.Key[:12]))
}

// restoreFailed handles a restore QEMU could not do (startErr): the
// snapshot is discarded and an event says why; the next spec built for the
// run boots (the run's restore failed: prepareSnapshotStart).
func (r *podRun) restoreFailed(ctx context.Context, pod *corev1.Pod, startErr error) {
	p, rec := r.node, r.rec
	u := rec.snap.used
	rec.snap.used, rec.snap.restoreFailed = nil, true
	msg := fmt.Sprintf("Starting from the memory snapshot failed; discarded it, booting instead: %v", startErr)
	if u != nil {
		if err := snapshot.Discard(u); err != nil {
			msg += fmt.Sprintf(" (removing the snapshot failed: %v)", err)
		}
	}
	klog.FromContext(ctx).Info("Snapshot restore failed; booting", "err", startErr)
	p.event(pod, corev1.EventTypeWarning, snapshot.ReasonRestoreFailed, msg)
}
