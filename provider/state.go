package provider

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podstatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// State preservation (docs/pods.md, "State preservation"): a pod's disk is
// its qcow2 overlay over the OS image, <stateDir>/vms/<uid>/disk.qcow2.
//
//   - statePolicy (annotation qemu-kubelet.io/state-policy, read when the
//     pod is created): Disabled gives every VM start a fresh overlay;
//     Retain starts from the overlay as the last run left it, as long as
//     it is over the image the VM boots (a flashed image or a new digest
//     starts a fresh one).
//   - reclaimPolicy (annotation qemu-kubelet.io/reclaim-policy, read when
//     the pod is deleted): Delete removes the disk with the pod; Retain
//     keeps a standalone copy under <stateDir>/retained/.
//
// Crash safety: an overlay appears at its path complete or not at all
// (created next to it and renamed), so a Retain start never finds a half
// made one; a retained copy is complete before its record is written, and
// the pod's state dir (which holds the source) is removed only after both,
// so an agent that dies mid-way redoes the missing steps when the pod is
// deleted again at its next start.

// RetainedFileName is the record of a retained disk: which pod it was.
const RetainedFileName = "retained.json"

// Event reasons of state preservation.
const (
	// ReasonStateRestored: a Retain pod's VM starts from its disk as the
	// last run left it (Normal).
	ReasonStateRestored = "StateRestored"
	// ReasonStateDiscarded: a Retain pod's disk was over another image
	// (flashed, or a new digest); the VM starts from a fresh disk (Normal).
	ReasonStateDiscarded = "StateDiscarded"
	// ReasonDiskRetained: a deleted pod's disk was kept (Normal).
	ReasonDiskRetained = "DiskRetained"
	// ReasonDiskRetainFailed: keeping a deleted pod's disk failed; the
	// pod's state dir is left in place and the next agent start retries
	// (Warning).
	ReasonDiskRetainFailed = "DiskRetainFailed"
)

// overlayFound is what a start finds at the overlay's path.
type overlayFound struct {
	// Exists: a file is there.
	Exists bool
	// Backing is its backing file as recorded in its qcow2 header.
	Backing string
	// Err is why it could not be read ("" = read).
	Err string
}

// overlayAction is what a start does with the overlay.
type overlayAction int

const (
	// overlayCreate: none there; create one over the image.
	overlayCreate overlayAction = iota + 1
	// overlayReplace: remove the one there and create a fresh one.
	overlayReplace
	// overlayReuse: start from the one there.
	overlayReuse
	// overlayRefuse: a Retain disk that cannot be read: do not start, do
	// not touch it (the start fails with the reason).
	overlayRefuse
)

// decideOverlay is what a VM start does with the pod's overlay, given the
// pod's state policy, what is at the overlay's path and the absolute path
// of the image disk the VM boots; why says it for events and errors. Pure.
func decideOverlay(policy v1alpha1.StatePolicy, found overlayFound, base string) (act overlayAction, why string) {
	if !found.Exists {
		return overlayCreate, ""
	}
	if policy != v1alpha1.StatePolicyRetain {
		return overlayReplace, "state policy Disabled: every VM start gets a fresh disk"
	}
	if found.Err != "" {
		return overlayRefuse, fmt.Sprintf("state policy Retain: the pod's disk %s cannot be read (%s); it is left untouched; delete the pod (its reclaim policy applies) or remove the file to start fresh", OverlayFileName, found.Err)
	}
	if found.Backing != base {
		was := found.Backing
		if was == "" {
			was = "no image"
		}
		return overlayReplace, fmt.Sprintf("state policy Retain: the pod's disk was over %s, the VM now boots %s (flashed or a new image digest): starting from a fresh disk", was, base)
	}
	return overlayReuse, "state policy Retain: starting from the pod's disk as the last run left it"
}

// inspectOverlay reads what is at path (for decideOverlay).
func inspectOverlay(ctx context.Context, path string) overlayFound {
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return overlayFound{}
	} else if err != nil {
		return overlayFound{Exists: true, Err: err.Error()}
	}
	info, err := qemu.InspectImage(ctx, path)
	if err != nil {
		return overlayFound{Exists: true, Err: err.Error()}
	}
	if info.Format != string(qemu.FormatQCOW2) {
		return overlayFound{Exists: true, Err: fmt.Sprintf("format %q, want qcow2", info.Format)}
	}
	return overlayFound{Exists: true, Backing: info.BackingFile}
}

// prepareOverlay makes the overlay at path ready for a start over base
// (format baseFormat) as the policy says. It returns the event to show
// (reason "" for none).
func prepareOverlay(ctx context.Context, policy v1alpha1.StatePolicy, path, base string, baseFormat qemu.DiskFormat) (reason, msg string, err error) {
	absBase, err := filepath.Abs(base)
	if err != nil {
		return "", "", fmt.Errorf("overlay: base %s: %w", base, err)
	}
	act, why := decideOverlay(policy, inspectOverlay(ctx, path), absBase)
	switch act {
	case overlayReuse:
		return ReasonStateRestored, why, nil
	case overlayRefuse:
		return "", "", errors.New(why)
	case overlayReplace:
		if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
			return "", "", fmt.Errorf("remove old overlay: %w", err)
		}
		if policy == v1alpha1.StatePolicyRetain {
			reason, msg = ReasonStateDiscarded, why
		}
	}
	// Created next to its path and renamed: a crash never leaves a half
	// made overlay where a Retain start would take it for the pod's disk.
	tmp := path + ".tmp"
	if err := os.Remove(tmp); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", "", fmt.Errorf("remove stale overlay: %w", err)
	}
	if err := qemu.CreateOverlay(ctx, absBase, baseFormat, tmp, 0); err != nil {
		return "", "", err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return "", "", fmt.Errorf("create overlay: %w", err)
	}
	return reason, msg, nil
}

// StatePolicyOf is the pod's state policy (annotation
// qemu-kubelet.io/state-policy; absent: Disabled). Translate validates it.
func StatePolicyOf(pod *corev1.Pod) v1alpha1.StatePolicy {
	if v1alpha1.StatePolicy(pod.Annotations[v1alpha1.StatePolicyAnnotation]) == v1alpha1.StatePolicyRetain {
		return v1alpha1.StatePolicyRetain
	}
	return v1alpha1.StatePolicyDisabled
}

// retainOnDelete says whether a deleted pod's disk is kept: its reclaim
// policy annotation as the pod is when deleted (metadata updates reach the
// node, so an admin may annotate a pod before deleting it to keep its
// disk). Pure.
func retainOnDelete(pod *corev1.Pod) bool {
	return v1alpha1.ReclaimPolicy(pod.Annotations[v1alpha1.ReclaimPolicyAnnotation]) == v1alpha1.ReclaimPolicyRetain
}

// RetainedDisk is the record (RetainedFileName) of a retained disk.
type RetainedDisk struct {
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	UID       types.UID `json:"uid"`
	// Owner is the pod's controller (kind/name), e.g. ExporterSet/rpi4.
	Owner string `json:"owner,omitempty"`
	// Image and ImageDigest are what the disk was over (its content now
	// includes the image: it is standalone).
	Image       string `json:"image,omitempty"`
	ImageDigest string `json:"imageDigest,omitempty"`
	StatePolicy string `json:"statePolicy"`
	// Disk is the file name of the disk in the directory.
	Disk       string    `json:"disk"`
	RetainedAt time.Time `json:"retainedAt"`
}

// retainedDirName is the directory of a pod's retained disk:
// <namespace>_<name>_<uid> (no "_" in namespaces, names or UIDs).
func retainedDirName(pod *corev1.Pod) string {
	return pod.Namespace + "_" + pod.Name + "_" + string(pod.UID)
}

// retainDisk keeps the disk in the pod's state dir dir as a standalone copy
// under <stateDir>/retained/ and writes its record after it. It returns
// the directory, "" when the pod has no disk. Idempotent: a disk already
// copied (an interrupted earlier call) is not copied again. The caller
// removes the state dir afterwards, and only if this succeeded.
func retainDisk(ctx context.Context, stateDir, dir string, pod *corev1.Pod, st podstatus.VMState, now time.Time) (string, error) {
	dst := filepath.Join(stateDir, nodestatus.RetainedDirName, retainedDirName(pod))
	disk := filepath.Join(dst, OverlayFileName)
	src := filepath.Join(dir, OverlayFileName)
	_, srcErr := os.Stat(src)
	if _, err := os.Stat(disk); errors.Is(err, os.ErrNotExist) {
		if errors.Is(srcErr, os.ErrNotExist) {
			return "", nil // never had a disk (e.g. a kernel-only image)
		}
		if err := os.MkdirAll(dst, 0o700); err != nil {
			return "", fmt.Errorf("retain disk: %w", err)
		}
		if err := qemu.FlattenDisk(ctx, src, disk); err != nil {
			return "", fmt.Errorf("retain disk: %w", err)
		}
	} else if err != nil {
		return "", fmt.Errorf("retain disk: %w", err)
	}
	rd := RetainedDisk{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID, Image: st.ImageID, ImageDigest: st.ImageDigest,
		StatePolicy: string(StatePolicyOf(pod)), Disk: OverlayFileName, RetainedAt: now.UTC()}
	if len(pod.Spec.Containers) > 0 && rd.Image == "" {
		rd.Image = pod.Spec.Containers[0].Image
	}
	for _, o := range pod.OwnerReferences {
		if o.Controller != nil && *o.Controller {
			rd.Owner = o.Kind + "/" + o.Name
		}
	}
	if err := writeJSONAtomic(filepath.Join(dst, RetainedFileName), rd); err != nil {
		return "", fmt.Errorf("retain disk: record: %w", err)
	}
	return dst, nil
}

// reclaimDisk applies a deleted pod's reclaim policy to its disk (its VM
// is gone). It reports whether the state dir may be removed: false when
// the disk was to be kept and could not be (the dir stays; the next agent
// start finds the pod gone and deletes it again, retrying).
func (p *VMs) reclaimDisk(ctx context.Context, rec *podVM, pod *corev1.Pod) bool {
	if !retainOnDelete(pod) {
		return true
	}
	if rec.handoff.unrecorded { // worker goroutine (finishDelete)
		return true // deleted before it was recorded: no disk to keep
	}
	rec.mu.Lock()
	st := rec.state
	rec.mu.Unlock()
	log := p.log.WithValues("pod", klog.KObj(pod), "uid", rec.uid)
	// The decision first: the intent record gets the pod as it is now (its
	// reclaim annotation may have come after it was bound), so a retry
	// after a crash mid-way keeps the disk too.
	if err := writeJSONAtomic(filepath.Join(rec.dir, PodFileName), pod); err != nil {
		log.Error(err, "Record the pod before keeping its disk; its state dir stays for a retry at the next start", "dir", rec.dir)
		p.event(pod, corev1.EventTypeWarning, ReasonDiskRetainFailed, fmt.Sprintf("reclaim policy Retain: recording the pod failed: %v; the pod's state dir %s is left in place", err, rec.dir))
		return false
	}
	dst, err := retainDisk(ctx, p.cfg.StateDir, rec.dir, pod, st, p.now())
	if err != nil {
		log.Error(err, "Keep the pod's disk (reclaim policy Retain); its state dir stays for a retry at the next start", "dir", rec.dir)
		p.event(pod, corev1.EventTypeWarning, ReasonDiskRetainFailed, fmt.Sprintf("reclaim policy Retain: keeping the VM's disk failed: %v; the pod's state dir %s is left in place", err, rec.dir))
		return false
	}
	if dst != "" {
		log.Info("Kept the pod's disk (reclaim policy Retain)", "dir", dst)
		p.event(pod, corev1.EventTypeNormal, ReasonDiskRetained, fmt.Sprintf("reclaim policy Retain: the VM's disk is kept on node %s in %s", p.cfg.NodeName, dst))
	}
	return true
}
