package provider

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/oci"
	"github.com/qemu-kubelet/qemu-kubelet/provider/podspec"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// Cold start from a memory snapshot (AnnotationStartFromSnapshot,
// docs/pods.md "Start from a memory snapshot").
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
// Who owns what: snapshotStore.creating names the one pod creating each
// key (the claim is taken by the pod's worker when it decides to boot a VM
// that will be snapshotted; released when the save ended, or when that run
// ended without reaching readiness). Only the claim holder writes its
// .tmp dir and renames it to <key>: a snapshot appears complete or not at
// all. Other pods of the key starting meanwhile boot normally. A restore
// that fails (QEMU cannot load the state) discards the snapshot and the pod
// boots instead (event SnapshotRestoreFailed); the next pod creates it anew.

// Pod event reasons of snapshot start.
const (
	// ReasonSnapshotSaved: the VM's state was saved at its ready point (Normal).
	ReasonSnapshotSaved = "SnapshotSaved"
	// ReasonSnapshotFailed: saving the snapshot failed (Warning); the VM
	// runs on.
	ReasonSnapshotFailed = "SnapshotFailed"
	// ReasonSnapshotRestoreFailed: restoring failed; the snapshot is
	// discarded and the VM boots (Warning).
	ReasonSnapshotRestoreFailed = "SnapshotRestoreFailed"
	// ReasonSnapshotSkipped: the pod asked for snapshot start but this node
	// cannot do it for this run (Warning); the VM boots.
	ReasonSnapshotSkipped = "SnapshotSkipped"
)

// Files of a snapshot directory.
const (
	snapshotAuxName   = "snapshots"
	SnapshotStateFile = "state"
	SnapshotDiskFile  = "disk.qcow2"
	SnapshotMetaFile  = "meta.json"
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
	n.RunAsUser = ""
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

// snapshotMeta is meta.json.
type snapshotMeta struct {
	Key          string    `json:"key"`
	ImageDigest  string    `json:"imageDigest"`
	QEMUVersion  string    `json:"qemuVersion"`
	Machine      string    `json:"machine"`
	CPUs         int       `json:"cpus"`
	MemoryMiB    int       `json:"memoryMiB"`
	Accelerator  string    `json:"accelerator"`
	StateBytes   int64     `json:"stateBytes"`
	Disk         bool      `json:"disk"`
	CreatedAt    time.Time `json:"createdAt"`
	CreatedByPod string    `json:"createdByPod"`
	PausedMillis int64     `json:"pausedMillis"`
}

// readSnapshot returns the published snapshot in dir, or false when there
// is none or it is incomplete (its state file not of the recorded size).
func readSnapshot(dir string) (snapshotMeta, bool) {
	var m snapshotMeta
	b, err := os.ReadFile(filepath.Join(dir, SnapshotMetaFile))
	if err != nil || json.Unmarshal(b, &m) != nil {
		return m, false
	}
	fi, err := os.Stat(filepath.Join(dir, SnapshotStateFile))
	if err != nil || fi.Size() != m.StateBytes || m.StateBytes == 0 {
		return m, false
	}
	if m.Disk {
		if _, err := os.Stat(filepath.Join(dir, SnapshotDiskFile)); err != nil {
			return m, false
		}
	}
	return m, true
}

// snapshotStore is the node's in-memory side of snapshots: who creates
// which key, and the QEMU versions.
type snapshotStore struct {
	mu       sync.Mutex
	creating map[string]types.UID
	versions map[string]string // "binary size mtime" -> version
}

func (s *snapshotStore) creator(key string) types.UID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.creating[key]
}

// claim makes uid the creator of key unless another pod is.
func (s *snapshotStore) claim(key string, uid types.UID) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if c, ok := s.creating[key]; ok && c != uid {
		return false
	}
	if s.creating == nil {
		s.creating = map[string]types.UID{}
	}
	s.creating[key] = uid
	return true
}

func (s *snapshotStore) release(key string, uid types.UID) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.creating[key] == uid {
		delete(s.creating, key)
	}
}

// qemuVersion identifies the QEMU binary for snapshot keys: its version
// (qemu.Version) and the binary's path, size and mtime (a rebuild or a
// distribution update of the same version is another QEMU). Cached while
// the binary's size and mtime stay the same.
func (s *snapshotStore) qemuVersion(ctx context.Context, binary string) (string, error) {
	path, err := exec.LookPath(binary)
	if err != nil {
		return "", err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return "", err
	}
	id := fmt.Sprintf("%s %d %d", path, fi.Size(), fi.ModTime().UnixNano())
	s.mu.Lock()
	v, ok := s.versions[id]
	s.mu.Unlock()
	if ok {
		return v, nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ver, err := qemu.Version(ctx, path)
	if err != nil {
		return "", err
	}
	v = ver + " (" + id + ")"
	s.mu.Lock()
	if s.versions == nil {
		s.versions = map[string]string{}
	}
	s.versions[id] = v
	s.mu.Unlock()
	return v, nil
}

// snapshotClaim is the creation a booting run owes once it is ready.
type snapshotClaim struct {
	key, dir, kdir string
	disk           bool
	meta           snapshotMeta
}

// snapshotUse is the snapshot a run was restored from.
type snapshotUse struct{ key, kdir string }

// prepareSnapshotStart decides how a run of a snapshot-start pod starts
// and adjusts spec: every VM of the key gets the key's MAC; a restore sets
// spec.Incoming and returns the overlay base (the snapshot's disk, "" for
// the image's). Worker goroutine only. Problems are events, never errors:
// the VM then boots.
func (p *VMs) prepareSnapshotStart(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image, spec *qemu.Spec) (overlayBase string) {
	if !plan.SnapshotStart {
		return ""
	}
	skip := func(err error) string {
		klog.FromContext(ctx).Info("Snapshot start skipped", "err", err)
		p.event(pod, corev1.EventTypeWarning, ReasonSnapshotSkipped, "Booting instead of starting from a memory snapshot: "+err.Error())
		return ""
	}
	if len(spec.Disks) > 1 || (len(spec.Disks) == 1 && img.Disk == "") {
		return skip(errors.New("the VM has guest disks besides the image's"))
	}
	binary := spec.QEMUBinary
	if binary == "" {
		binary = spec.Arch.Binary()
	}
	version, err := p.snaps.qemuVersion(ctx, binary)
	if err != nil {
		return skip(err)
	}
	var firmware []string
	if spec.Firmware == qemu.FirmwareUEFI {
		for _, f := range []string{spec.UEFICode, spec.UEFIVarsTemplate} {
			fi, err := os.Stat(f)
			if err != nil {
				return skip(err)
			}
			firmware = append(firmware, fmt.Sprintf("%s %d %d", f, fi.Size(), fi.ModTime().UnixNano()))
		}
	}
	key := snapshotKey(*spec, img.Digest, version, firmware)
	spec.MAC = snapshotMAC(key)
	dir, err := p.cfg.Images.AuxDir(img.Digest, snapshotAuxName)
	if err != nil {
		return skip(err)
	}
	kdir := filepath.Join(dir, key)
	meta, published := readSnapshot(kdir)
	rec.mu.Lock()
	afterFailed := rec.snap.restoreFailed
	rec.mu.Unlock()
	switch decideSnapshot(published, afterFailed, p.snaps.creator(key), rec.uid) {
	case snapRestore:
		spec.Incoming = filepath.Join(kdir, SnapshotStateFile)
		rec.mu.Lock()
		rec.snap.used = &snapshotUse{key: key, kdir: kdir}
		rec.mu.Unlock()
		if meta.Disk {
			return filepath.Join(kdir, SnapshotDiskFile)
		}
		return ""
	case snapCreate:
		if !p.snaps.claim(key, rec.uid) {
			return ""
		}
		// Leftovers of a creation that did not finish (e.g. a node crash):
		// ours now, as the claim holder.
		if old, _ := filepath.Glob(filepath.Join(dir, "."+key+".tmp-*")); len(old) > 0 {
			for _, o := range old {
				os.RemoveAll(o)
			}
		}
		if _, err := os.Stat(kdir); err == nil {
			os.RemoveAll(kdir) // incomplete (readSnapshot said so)
		}
		c := &snapshotClaim{key: key, dir: dir, kdir: kdir, disk: img.Disk != "", meta: snapshotMeta{
			Key: key, ImageDigest: img.Digest, QEMUVersion: version, Machine: spec.Machine, CPUs: spec.CPUs,
			MemoryMiB: spec.MemoryMiB, Accelerator: string(spec.Accelerator), Disk: img.Disk != "",
			CreatedByPod: pod.Namespace + "/" + pod.Name,
		}}
		rec.mu.Lock()
		rec.snap.claim = c
		rec.mu.Unlock()
	}
	return ""
}

// dropSnapshotClaim releases a claim the run did not use (it ended before
// readiness, or the pod goes).
func (p *VMs) dropSnapshotClaim(rec *podVM) {
	rec.mu.Lock()
	c := rec.snap.claim
	rec.snap.claim = nil
	rec.mu.Unlock()
	if c != nil {
		p.snaps.release(c.key, rec.uid)
	}
}

// discardSnapshot removes a snapshot a restore failed from (renamed away
// first: nobody starts from it any more; VMs that opened it keep their open
// files).
func discardSnapshot(u *snapshotUse) error {
	trash := filepath.Join(filepath.Dir(u.kdir), "."+u.key+".bad-"+fmt.Sprint(time.Now().UnixNano()))
	if err := os.Rename(u.kdir, trash); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	return os.RemoveAll(trash)
}

// captureSnapshot saves the snapshot the run owes, now that it is ready
// (the readiness probe's first success). Asynchronous; the claim is
// released when it ends.
func (p *VMs) captureSnapshot(ctx context.Context, rec *podVM, vm VM) {
	rec.mu.Lock()
	c := rec.snap.claim
	rec.snap.claim = nil
	pod := rec.pod.DeepCopy()
	rec.mu.Unlock()
	if c == nil {
		return
	}
	go func() {
		defer p.snaps.release(c.key, rec.uid)
		log := klog.FromContext(ctx)
		m, err := p.saveSnapshot(ctx, rec, vm, c)
		if err != nil {
			log.Error(err, "Save memory snapshot")
			p.event(pod, corev1.EventTypeWarning, ReasonSnapshotFailed, fmt.Sprintf("Saving a memory snapshot of the VM failed (it runs on): %v", err))
			return
		}
		log.Info("Memory snapshot saved", "key", c.key, "bytes", m.StateBytes, "pausedMs", m.PausedMillis)
		p.event(pod, corev1.EventTypeNormal, ReasonSnapshotSaved, fmt.Sprintf(
			"Saved a memory snapshot of the VM at its ready point (%d MiB, guest paused %d ms); pods of the same image and VM shape start from it (key %s)",
			m.StateBytes>>20, m.PausedMillis, c.key[:12]))
	}()
}

func (p *VMs) saveSnapshot(ctx context.Context, rec *podVM, vm VM, c *snapshotClaim) (snapshotMeta, error) {
	m := c.meta
	tmp := filepath.Join(c.dir, "."+c.key+".tmp-"+string(rec.uid))
	if err := os.RemoveAll(tmp); err != nil {
		return m, err
	}
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return m, err
	}
	ok := false
	defer func() {
		if !ok {
			os.RemoveAll(tmp)
		}
	}()
	sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	saved, err := vm.SaveState(sctx, filepath.Join(tmp, SnapshotStateFile), func() error {
		if !c.disk {
			return nil
		}
		// The guest is paused and QEMU flushed the overlay: this copy is
		// the disk the saved memory knows.
		return copyFileSync(filepath.Join(rec.dir, OverlayFileName), filepath.Join(tmp, SnapshotDiskFile), 0o444)
	})
	if err != nil {
		return m, err
	}
	if err := os.Chmod(filepath.Join(tmp, SnapshotStateFile), 0o400); err != nil {
		return m, err
	}
	m.StateBytes, m.PausedMillis, m.CreatedAt = saved.Bytes, saved.Paused.Milliseconds(), time.Now().UTC()
	b, _ := json.MarshalIndent(m, "", "  ")
	if err := writeSynced(filepath.Join(tmp, SnapshotMetaFile), b, 0o444); err != nil {
		return m, err
	}
	if err := syncPath(tmp); err != nil {
		return m, err
	}
	if err := os.Rename(tmp, c.kdir); err != nil {
		return m, fmt.Errorf("publish snapshot: %w", err)
	}
	ok = true
	return m, syncPath(c.dir)
}

func copyFileSync(src, dst string, perm os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func writeSynced(path string, b []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, perm)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func syncPath(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// restoreFailed handles a restore QEMU could not do (startErr): the
// snapshot is discarded, an event says why, and the spec of a normal boot
// is returned.
func (p *VMs) restoreFailed(ctx context.Context, rec *podVM, pod *corev1.Pod, plan podspec.Plan, img *oci.Image, startErr error) (qemu.Spec, error) {
	rec.mu.Lock()
	u := rec.snap.used
	rec.snap.used, rec.snap.restoreFailed = nil, true
	rec.mu.Unlock()
	msg := fmt.Sprintf("Starting from the memory snapshot failed; discarded it, booting instead: %v", startErr)
	if u != nil {
		if err := discardSnapshot(u); err != nil {
			msg += fmt.Sprintf(" (removing the snapshot failed: %v)", err)
		}
	}
	klog.FromContext(ctx).Info("Snapshot restore failed; booting", "err", startErr)
	p.event(pod, corev1.EventTypeWarning, ReasonSnapshotRestoreFailed, msg)
	return p.vmSpec(ctx, rec, pod, plan, img)
}
