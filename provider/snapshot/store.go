package snapshot

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"k8s.io/apimachinery/pkg/types"
)

// Meta is meta.json.
type Meta struct {
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

// Read returns the published snapshot in dir, or false when there is none
// or it is incomplete (its state file not of the recorded size).
func Read(dir string) (Meta, bool) {
	var m Meta
	b, err := os.ReadFile(filepath.Join(dir, MetaFile))
	if err != nil || json.Unmarshal(b, &m) != nil {
		return m, false
	}
	fi, err := os.Stat(filepath.Join(dir, StateFile))
	if err != nil || fi.Size() != m.StateBytes || m.StateBytes == 0 {
		return m, false
	}
	if m.Disk {
		if _, err := os.Stat(filepath.Join(dir, DiskFile)); err != nil {
			return m, false
		}
	}
	return m, true
}

// Store is the node's in-memory side of snapshots: who creates which key,
// and the QEMU versions. Its zero value is ready; safe for concurrent use
// (mu is a leaf lock).
type Store struct {
	mu       sync.Mutex
	creating map[string]types.UID
	versions map[string]string // "binary size mtime" -> version
}

func (s *Store) creator(key string) types.UID {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.creating[key]
}

// claim makes uid the creator of key unless another pod is.
func (s *Store) claim(key string, uid types.UID) bool {
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

func (s *Store) release(key string, uid types.UID) {
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
func (s *Store) qemuVersion(ctx context.Context, binary string) (string, error) {
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

// Claim is the creation a booting run owes once it is ready: its pod is
// the key's creator until Release.
type Claim struct {
	key, dir, kdir string
	uid            types.UID
	disk           bool
	meta           Meta
}

// Use is the snapshot a run was restored from.
type Use struct{ key, kdir string }

// Images gives the directory kept with a cached image (oci.Store.AuxDir).
type Images interface {
	AuxDir(digest, name string) (string, error)
}

// Request is a run of a snapshot-start pod about to start.
type Request struct {
	UID types.UID
	// Pod is "namespace/name", recorded as the creator.
	Pod string
	// ImageDigest is the image the VM boots; ImageDisk: the image has a
	// disk (the VM's overlay is over it).
	ImageDigest string
	ImageDisk   bool
	// AfterFailedRestore: the pod's previous start failed to restore;
	// this run boots (and may create the snapshot anew).
	AfterFailedRestore bool
}

// Start is how a run starts: restored from Use (Overlay is its disk, ""
// for the image's), or booted owing the snapshot of Claim, or booted
// (both nil).
type Start struct {
	Claim   *Claim
	Use     *Use
	Overlay string
}

// Prepare decides how a run of a snapshot-start pod starts and adjusts
// spec: every VM of the key gets the key's MAC; a restore sets
// spec.Incoming. An error says why this run cannot use snapshots (the VM
// then boots).
func (s *Store) Prepare(ctx context.Context, images Images, r Request, spec *qemu.Spec) (Start, error) {
	if len(spec.Disks) > 1 || (len(spec.Disks) == 1 && !r.ImageDisk) {
		return Start{}, errors.New("the VM has guest disks besides the image's")
	}
	binary := spec.QEMUBinary
	if binary == "" {
		binary = spec.Arch.Binary()
	}
	version, err := s.qemuVersion(ctx, binary)
	if err != nil {
		return Start{}, err
	}
	var firmware []string
	if spec.Firmware == qemu.FirmwareUEFI {
		for _, f := range []string{spec.UEFICode, spec.UEFIVarsTemplate} {
			fi, err := os.Stat(f)
			if err != nil {
				return Start{}, err
			}
			firmware = append(firmware, fmt.Sprintf("%s %d %d", f, fi.Size(), fi.ModTime().UnixNano()))
		}
	}
	key := snapshotKey(*spec, r.ImageDigest, version, firmware)
	spec.MAC = snapshotMAC(key)
	dir, err := images.AuxDir(r.ImageDigest, AuxName)
	if err != nil {
		return Start{}, err
	}
	kdir := filepath.Join(dir, key)
	meta, published := Read(kdir)
	switch decideSnapshot(published, r.AfterFailedRestore, s.creator(key), r.UID) {
	case snapRestore:
		spec.Incoming = filepath.Join(kdir, StateFile)
		st := Start{Use: &Use{key: key, kdir: kdir}}
		if meta.Disk {
			st.Overlay = filepath.Join(kdir, DiskFile)
		}
		return st, nil
	case snapCreate:
		if !s.claim(key, r.UID) {
			return Start{}, nil
		}
		// Leftovers of a creation that did not finish (e.g. a node crash):
		// ours now, as the claim holder.
		if old, _ := filepath.Glob(filepath.Join(dir, "."+key+".tmp-*")); len(old) > 0 {
			for _, o := range old {
				os.RemoveAll(o)
			}
		}
		if _, err := os.Stat(kdir); err == nil {
			os.RemoveAll(kdir) // incomplete (Read said so)
		}
		return Start{Claim: &Claim{key: key, dir: dir, kdir: kdir, uid: r.UID, disk: r.ImageDisk, meta: Meta{
			Key: key, ImageDigest: r.ImageDigest, QEMUVersion: version, Machine: spec.Machine, CPUs: spec.CPUs,
			MemoryMiB: spec.MemoryMiB, Accelerator: string(spec.Accelerator), Disk: r.ImageDisk,
			CreatedByPod: r.Pod,
		}}}, nil
	}
	return Start{}, nil
}

// Release ends claim c (saved or not): another pod may create its key.
// A nil c is no claim.
func (s *Store) Release(c *Claim) {
	if c != nil {
		s.release(c.key, c.uid)
	}
}

// VM is the running VM a snapshot is saved from (*qemu.VM).
type VM interface {
	SaveState(ctx context.Context, path string, whileStopped func() error) (qemu.SavedState, error)
}

// Save saves the snapshot claim c owes from vm, whose writable overlay is
// overlay (copied while the guest is paused, for an image with a disk),
// and publishes it by renaming its temporary directory. The claim stays
// held (Release).
func (s *Store) Save(ctx context.Context, vm VM, c *Claim, overlay string) (Meta, error) {
	m := c.meta
	tmp := filepath.Join(c.dir, "."+c.key+".tmp-"+string(c.uid))
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
	saved, err := vm.SaveState(sctx, filepath.Join(tmp, StateFile), func() error {
		if !c.disk {
			return nil
		}
		// The guest is paused and QEMU flushed the overlay: this copy is
		// the disk the saved memory knows.
		return copyFileSync(overlay, filepath.Join(tmp, DiskFile), 0o444)
	})
	if err != nil {
		return m, err
	}
	if err := os.Chmod(filepath.Join(tmp, StateFile), 0o400); err != nil {
		return m, err
	}
	m.StateBytes, m.PausedMillis, m.CreatedAt = saved.Bytes, saved.Paused.Milliseconds(), time.Now().UTC()
	b, _ := json.MarshalIndent(m, "", "  ")
	if err := writeSynced(filepath.Join(tmp, MetaFile), b, 0o444); err != nil {
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

// Discard removes a snapshot a restore failed from (renamed away first:
// nobody starts from it any more; VMs that opened it keep their open
// files).
func Discard(u *Use) error {
	trash := filepath.Join(filepath.Dir(u.kdir), "."+u.key+".bad-"+fmt.Sprint(time.Now().UnixNano()))
	if err := os.Rename(u.kdir, trash); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return err
	}
	return os.RemoveAll(trash)
}
