package provider

import (
	"context"
	"fmt"
	"path/filepath"

	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/poddisk"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// The worker's side of a pod's disk across runs and after its delete
// (package poddisk): start.go prepares the overlay of each start
// (poddisk.Prepare); finishDelete applies the reclaim policy here.

// reclaimDisk applies a deleted pod's reclaim policy to its disk (its VM
// is gone). It reports whether the state dir may be removed: false when
// the disk was to be kept and could not be (the dir stays; the next agent
// start finds the pod gone and deletes it again, retrying).
func (r *podRun) reclaimDisk(ctx context.Context, pod *corev1.Pod) bool {
	p, rec := r.node, r.rec
	if !poddisk.RetainOnDelete(pod) {
		return true
	}
	if rec.handoff.unrecorded { // worker goroutine (finishDelete)
		return true // deleted before it was recorded: no disk to keep
	}
	st := rec.stateCopy()
	log := p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	// The decision first: the intent record gets the pod as it is now (its
	// reclaim annotation may have come after it was bound), so a retry
	// after a crash mid-way keeps the disk too.
	if err := atomicfile.WriteJSON(filepath.Join(rec.dir, PodFileName), pod); err != nil {
		log.Error(err, "Record the pod before keeping its disk; its state dir stays for a retry at the next start", "dir", rec.dir)
		p.event(pod, corev1.EventTypeWarning, poddisk.ReasonDiskRetainFailed, fmt.Sprintf("reclaim policy Retain: recording the pod failed: %v; the pod's state dir %s is left in place", err, rec.dir))
		return false
	}
	dst, err := poddisk.Retain(ctx, p.cfg.StateDir, rec.dir, pod, st.ImageID, st.ImageDigest, p.now())
	if err != nil {
		log.Error(err, "Keep the pod's disk (reclaim policy Retain); its state dir stays for a retry at the next start", "dir", rec.dir)
		p.event(pod, corev1.EventTypeWarning, poddisk.ReasonDiskRetainFailed, fmt.Sprintf("reclaim policy Retain: keeping the VM's disk failed: %v; the pod's state dir %s is left in place", err, rec.dir))
		return false
	}
	if dst != "" {
		log.Info("Kept the pod's disk (reclaim policy Retain)", "dir", dst)
		p.event(pod, corev1.EventTypeNormal, poddisk.ReasonDiskRetained, fmt.Sprintf("reclaim policy Retain: the VM's disk is kept on node %s in %s", p.cfg.NodeName, dst))
	}
	return true
}
