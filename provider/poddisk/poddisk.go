// Package poddisk is a pod's writable disk across its runs and after its
// delete (docs/pods.md, "State preservation"): the overlay a VM start uses
// as the pod's state policy says (Prepare), and the standalone copy a
// delete keeps as its reclaim policy says (Retain) with its record
// (RetainedDisk).
//
// poddisk knows package qemu's disk tools and the node's retained-disk
// area (nodestatus.RetainedDirName); it knows nothing of the pod worker
// (package provider decides when, and reports the events).
package poddisk

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/provider/internal/atomicfile"
	"github.com/qemu-kubelet/qemu-kubelet/provider/nodestatus"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// A pod's disk is its qcow2 overlay over the OS image,
// <stateDir>/vms/<uid>/disk.qcow2.
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

// Files of a pod's disk.
const (
	// OverlayFileName is the VM's writable disk (qcow2 over the image), in
	// the pod's state dir and in its retained dir.
	OverlayFileName = "disk.qcow2"
	// RetainedFileName is the record of a retained disk: which pod it was.
	RetainedFileName = "retained.json"
)

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

// Prepare makes the overlay at path ready for a start over base (format
// baseFormat) as the policy says. It returns the event to show (reason ""
// for none).
func Prepare(ctx context.Context, policy v1alpha1.StatePolicy, path, base string, baseFormat qemu.DiskFormat) (reason, msg string, err error) {
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

// RetainOnDelete says whether a deleted pod's disk is kept: its reclaim
// policy annotation as the pod is when deleted (metadata updates reach the
// node, so an admin may annotate a pod before deleting it to keep its
// disk). Pure.
func RetainOnDelete(pod *corev1.Pod) bool {
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

// Retain keeps the disk in the pod's state dir dir as a standalone copy
// under <stateDir>/retained/ and writes its record after it; image and
// imageDigest are what the disk is over (the pod's VMState). It returns
// the directory, "" when the pod has no disk. Idempotent: a disk already
// copied (an interrupted earlier call) is not copied again. The caller
// removes the state dir afterwards, and only if this succeeded.
func Retain(ctx context.Context, stateDir, dir string, pod *corev1.Pod, image, imageDigest string, now time.Time) (string, error) {
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
	rd := RetainedDisk{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID, Image: image, ImageDigest: imageDigest,
		StatePolicy: string(StatePolicyOf(pod)), Disk: OverlayFileName, RetainedAt: now.UTC()}
	if len(pod.Spec.Containers) > 0 && rd.Image == "" {
		rd.Image = pod.Spec.Containers[0].Image
	}
	for _, o := range pod.OwnerReferences {
		if o.Controller != nil && *o.Controller {
			rd.Owner = o.Kind + "/" + o.Name
		}
	}
	if err := atomicfile.WriteJSON(filepath.Join(dst, RetainedFileName), rd); err != nil {
		return "", fmt.Errorf("retain disk: record: %w", err)
	}
	return dst, nil
}
