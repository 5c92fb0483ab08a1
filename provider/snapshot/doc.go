// Package snapshot owns the memory snapshots a snapshot-start pod
// (podspec.AnnotationStartFromSnapshot, docs/pods.md "Start from a memory
// snapshot") starts from: their keys, their metadata (meta.json), their
// layout next to the cached image, who creates which key, and the save,
// publish, read and discard of one snapshot.
//
// A snapshot is the memory and device state of a VM saved (qemu.SaveState)
// at the first success of its pod's readiness probe, plus, for an image with
// a disk, a copy of the VM's overlay taken at the same instant (the guest is
// paused and QEMU flushed the disk): restored VMs get a fresh overlay over
// that copy, so their disk holds exactly what the saved memory expects.
//
// Layout, next to the cached image (oci.Store.AuxDir, removed with the image
// by its GC; a new image digest is a new entry):
//
//	<image entry>/aux/snapshots/<key>/state       QEMU migration stream (0400)
//	                                 /disk.qcow2   overlay copy over the image disk (0444; disk images only)
//	                                 /meta.json    what it was taken from; written last
//	<image entry>/aux/snapshots/.<key>.tmp-<uid>/  a snapshot being written by pod <uid>
//
// The key hashes everything a restore depends on: the image digest, the
// QEMU binary's version, the VM's QEMU arguments with the per-VM parts
// (name, state dir, forwards, disk paths) made equal (so machine type,
// vCPUs, memory, accelerator, firmware, kernel command line, memory tuning
// and the device set, NIC model included, are all in it) and the size and
// mtime of the firmware files. Any difference is another key.
//
// Who owns what: Store names the one pod creating each key (the Claim is
// taken by the pod's worker when it decides to boot a VM that will be
// snapshotted, Store.Prepare; released, Store.Release, when the save ended
// or when that run ended without reaching readiness). Only the claim
// holder writes its .tmp dir and renames it to <key> (Store.Save): a
// snapshot appears complete or not at all. Other pods of the key starting
// meanwhile boot normally. A restore that fails (QEMU cannot load the
// state) discards the snapshot (Discard) and the pod boots instead; the
// next pod creates it anew.
//
// When to snapshot and what a pod's events say are the pod worker's
// (package provider): it calls Prepare before a start, Save at readiness,
// Release when a run ends, Discard after a failed restore. snapshot knows
// packages qemu and oci's image layout through the small interfaces Images
// and VM; it knows nothing of the pod worker.
package snapshot
