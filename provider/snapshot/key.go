package snapshot

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"k8s.io/apimachinery/pkg/types"
)

// Pod event reasons of snapshot start (the pod worker records them).
const (
	// ReasonSaved: the VM's state was saved at its ready point (Normal).
	ReasonSaved = "SnapshotSaved"
	// ReasonFailed: saving the snapshot failed (Warning); the VM runs on.
	ReasonFailed = "SnapshotFailed"
	// ReasonRestoreFailed: restoring failed; the snapshot is discarded and
	// the VM boots (Warning).
	ReasonRestoreFailed = "SnapshotRestoreFailed"
	// ReasonSkipped: the pod asked for snapshot start but this node cannot
	// do it for this run (Warning); the VM boots.
	ReasonSkipped = "SnapshotSkipped"
)

// Files of a snapshot directory.
const (
	// AuxName is the image entry's aux directory that holds its snapshots.
	AuxName   = "snapshots"
	StateFile = "state"
	DiskFile  = "disk.qcow2"
	MetaFile  = "meta.json"
	// snapshotKeyVersion changes when what a key covers changes.
	snapshotKeyVersion = "qemu-kubelet snapshot v1"
)

// snapshotArgs is the VM's QEMU command line with the per-VM parts made
// equal: two VMs with the same snapshotArgs can load each other's state.
// Pure.
func snapshotArgs(spec qemu.Spec) []string {
	n := spec
	n.Name = "snapshot"
	n.StateDir = "/snapshot"
	n.Forwards = nil
	n.MAC = ""
	n.Incoming = ""
	n.RunAs = nil
	n.ConsoleCapBytes = 0
	n.Disks = append([]qemu.Disk(nil), spec.Disks...)
	for i := range n.Disks {
		n.Disks[i].Path = fmt.Sprintf("/disk%d", i)
	}
	return qemu.Args(n)
}

// snapshotKey is the key of the snapshot a VM of spec booting image
// imageDigest can start from, with QEMU qemuVersion and firmware files
// stamped as firmware ("path size mtime"). Pure.
func snapshotKey(spec qemu.Spec, imageDigest, qemuVersion string, firmware []string) string {
	h := sha256.New()
	for _, s := range append([]string{snapshotKeyVersion, imageDigest, qemuVersion, strings.Join(firmware, "\n")}, snapshotArgs(spec)...) {
		fmt.Fprintf(h, "%d:%s\n", len(s), s)
	}
	return hex.EncodeToString(h.Sum(nil))[:40]
}

// snapshotMAC is the MAC every VM of a key uses: the NIC's saved state
// carries it, so a restored VM has the creator's MAC anyway.
func snapshotMAC(key string) string {
	return "52:54:00:" + key[0:2] + ":" + key[2:4] + ":" + key[4:6]
}

// snapshotAction is how a run of a snapshot-start pod starts.
type snapshotAction int

const (
	snapBoot    snapshotAction = iota // boot; no snapshot made by this run
	snapRestore                       // restore the published snapshot
	snapCreate                        // boot, and save the snapshot at readiness (claim taken)
)

// decideSnapshot: restore a published snapshot unless this run follows a
// failed restore; otherwise create it when nobody else does. Pure.
func decideSnapshot(published, afterFailedRestore bool, creator, self types.UID) snapshotAction {
	switch {
	case published && !afterFailedRestore:
		return snapRestore
	case published:
		return snapBoot
	case creator == "" || creator == self:
		return snapCreate
	default:
		return snapBoot
	}
}
