package nodestatus

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// RetainedDirName is the directory under the node's state dir that holds
// the disks of deleted pods whose reclaim policy is Retain, one directory
// per pod: <namespace>_<name>_<uid>/ with disk.qcow2 and RetainedFileName.
const RetainedDirName = "retained"

// RetainedBytes is the disk space the retained disks under stateDir take
// (allocated blocks, so sparse disks count what they use): the node counts
// it as reserved ephemeral-storage. A missing directory is 0.
func RetainedBytes(stateDir string) (int64, error) {
	var total int64
	root := filepath.Join(stateDir, RetainedDirName)
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil
			}
			return err
		}
		if !d.Type().IsRegular() {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return nil
			}
			return err
		}
		total += allocatedBytes(info)
		return nil
	})
	if err != nil {
		return total, fmt.Errorf("retained disks under %s: %w", root, err)
	}
	return total, nil
}

// allocatedBytes is the space a file takes on disk (its size when the file
// system does not say).
func allocatedBytes(info fs.FileInfo) int64 {
	if st, ok := info.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return info.Size()
}

// reservedWithRetained is the node's reserved resources plus the space of
// retained disks as ephemeral-storage: what a deleted pod's kept disk
// takes is not allocatable to pods. Pure.
func reservedWithRetained(reserved corev1.ResourceList, retained int64) corev1.ResourceList {
	if retained <= 0 {
		return reserved
	}
	out := reserved.DeepCopy()
	if out == nil {
		out = corev1.ResourceList{}
	}
	q := out[corev1.ResourceEphemeralStorage]
	q.Add(*resource.NewQuantity(retained, resource.BinarySI))
	out[corev1.ResourceEphemeralStorage] = q
	return out
}
