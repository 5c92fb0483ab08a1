package qemu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
)

// User is a uid and gid QEMU runs as (Spec.RunAs), numeric: it need not
// name an account of the host (or of the agent's container image).
type User struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

// MaxID is the largest uid or gid a User may have ((uid_t)-1 means "no
// change" to the kernel).
const MaxID = 1<<32 - 2

// KVMDevice is the KVM device a VM run as Spec.RunAs opens through its
// group (kvmGroup).
var KVMDevice = "/dev/kvm"

// credential is what QEMU runs as for spec s: RunAs with its gid and, under
// KVM, the group of KVMDevice when that group may open it (as udev's kvm
// group does). Nil without RunAs.
func (s Spec) credential() *syscall.Credential {
	if s.RunAs == nil {
		return nil
	}
	c := &syscall.Credential{Uid: s.RunAs.UID, Gid: s.RunAs.GID, Groups: []uint32{}}
	if s.Accelerator == AccelKVM {
		if g, ok := kvmGroup(KVMDevice); ok && g != s.RunAs.GID {
			c.Groups = append(c.Groups, g)
		}
	}
	return c
}

// kvmGroup returns the group of the KVM device when its group may read and
// write it.
func kvmGroup(dev string) (uint32, bool) {
	fi, err := os.Stat(dev)
	if err != nil {
		return 0, false
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok || fi.Mode().Perm()&0o060 != 0o060 {
		return 0, false
	}
	return st.Gid, true
}

// handOver gives the user spec.RunAs what its QEMU opens, and nothing
// more. The state dir stays the caller's, with the user's group, mode
// 01770: QEMU creates its sockets, pidfile and console log there, reads
// nothing of the caller's files (spec.json, qemu.log, anything 0600), and
// (sticky) can neither remove nor replace them. The files QEMU opens
// inside the state dir (disks and their backing chains, firmware and
// kernel files, the UEFI vars copy) are chowned to the user, and every
// directory between them and the state dir gets the user's group with
// search permission only. A file outside the state dir is not changed:
// its directories must be searchable and it readable by the user
// (reachable), else an error names it. Run again on every start: a VM
// dir left by a start as another user (or as the caller) is handed over
// anew.
func handOver(s Spec) error {
	u := s.RunAs
	cred := s.credential()
	if err := os.Lchown(s.StateDir, -1, int(u.GID)); err != nil {
		return fmt.Errorf("give the state dir to group %d: %w", u.GID, err)
	}
	if err := os.Chmod(s.StateDir, 0o770|os.ModeSticky); err != nil {
		return fmt.Errorf("chmod state dir: %w", err)
	}
	if err := reachable(cred, filepath.Dir(s.StateDir), false); err != nil {
		return fmt.Errorf("state dir %s: %w", s.StateDir, err)
	}
	for _, f := range qemuFiles(s) {
		if !s.insideStateDir(f.path) {
			if err := reachable(cred, f.path, true); err != nil {
				return fmt.Errorf("%s: %w", f.what, err)
			}
			continue
		}
		for d := filepath.Dir(f.path); d != s.StateDir && s.insideStateDir(d); d = filepath.Dir(d) {
			if err := os.Lchown(d, -1, int(u.GID)); err != nil {
				return fmt.Errorf("%s: give %s to group %d: %w", f.what, d, u.GID, err)
			}
			fi, err := os.Lstat(d)
			if err != nil {
				return fmt.Errorf("%s: %w", f.what, err)
			}
			if err := os.Chmod(d, fi.Mode().Perm()&^0o077|0o010); err != nil {
				return fmt.Errorf("%s: chmod %s: %w", f.what, d, err)
			}
		}
		if err := os.Lchown(f.path, int(u.UID), int(u.GID)); err != nil {
			return fmt.Errorf("%s: give %s to uid %d: %w", f.what, f.path, u.UID, err)
		}
	}
	return nil
}

func (s Spec) insideStateDir(p string) bool {
	rel, err := filepath.Rel(s.StateDir, filepath.Clean(p))
	return err == nil && rel != "." && rel != ".." && !filepath.IsAbs(rel) && !startsWithDotDot(rel)
}

func startsWithDotDot(rel string) bool {
	return len(rel) >= 3 && rel[:3] == "../"
}

// qemuFile is a file QEMU opens, named for errors.
type qemuFile struct{ what, path string }

// qemuFiles lists the files QEMU opens for spec s (not the ones it creates:
// sockets, pidfile, console log): kernel, initrd, firmware, the UEFI vars
// copy, every disk and the qcow2 backing files behind it.
func qemuFiles(s Spec) []qemuFile {
	var out []qemuFile
	add := func(what, p string) {
		if p != "" {
			out = append(out, qemuFile{what, p})
		}
	}
	add("kernel", s.Kernel)
	add("initrd", s.Initrd)
	if s.Firmware == FirmwareUEFI {
		add("uefi code", s.UEFICode)
		add("uefi vars", s.Path(UEFIVarsName))
	} else {
		add("bios", s.BIOS)
	}
	for i, d := range s.Disks {
		what := fmt.Sprintf("disk[%d]", i)
		add(what, d.Path)
		if d.Format != FormatQCOW2 {
			continue
		}
		p := d.Path
		for depth := 0; depth < 16; depth++ {
			b, err := qcow2Backing(p)
			if err != nil || b == "" {
				break
			}
			if !filepath.IsAbs(b) {
				b = filepath.Join(filepath.Dir(p), b)
			}
			add(what+" backing file", b)
			p = b
		}
	}
	return out
}

// qcow2Backing returns the backing file a qcow2 image's header names (""
// for none, or for a file that is no qcow2 image).
func qcow2Backing(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	var h [20]byte
	if _, err := io.ReadFull(f, h[:]); err != nil {
		return "", nil
	}
	if string(h[:4]) != "QFI\xfb" {
		return "", nil
	}
	off, size := binary.BigEndian.Uint64(h[8:16]), binary.BigEndian.Uint32(h[16:20])
	if off == 0 || size == 0 || size > 1023 {
		return "", nil
	}
	name := make([]byte, size)
	if _, err := f.ReadAt(name, int64(off)); err != nil {
		return "", fmt.Errorf("qcow2 %s: backing file name: %w", path, err)
	}
	return string(name), nil
}

// errNotReachable: the user cannot open a path.
var errNotReachable = errors.New("not reachable by the VM's user")

// reachable checks that cred may search every directory down to p and,
// with file, read p (a directory p needs search permission only).
func reachable(cred *syscall.Credential, p string, file bool) error {
	p = filepath.Clean(p)
	var dirs []string
	for d := p; ; d = filepath.Dir(d) {
		dirs = append(dirs, d)
		if d == "/" || d == "." {
			break
		}
	}
	slices.Reverse(dirs)
	for i, d := range dirs {
		fi, err := os.Stat(d)
		if err != nil {
			return err
		}
		want := uint32(1) // search
		if file && i == len(dirs)-1 {
			want = 4 // read
		}
		if !permits(cred, fi, want) {
			st := fi.Sys().(*syscall.Stat_t)
			return fmt.Errorf("%w: %s (mode %v, owner %d:%d) is not %s by uid %d gid %d", errNotReachable, d, fi.Mode().Perm(), st.Uid, st.Gid,
				map[uint32]string{1: "searchable", 4: "readable"}[want], cred.Uid, cred.Gid)
		}
	}
	return nil
}

// permits applies the owner/group/other bits of fi for cred (bit: 4 read,
// 1 search/execute).
func permits(cred *syscall.Credential, fi os.FileInfo, bit uint32) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return false
	}
	if cred.Uid == 0 {
		return true
	}
	m := uint32(fi.Mode().Perm())
	switch {
	case st.Uid == cred.Uid:
		return m>>6&bit != 0
	case st.Gid == cred.Gid || slices.Contains(cred.Groups, st.Gid):
		return m>>3&bit != 0
	default:
		return m&bit != 0
	}
}

// Reachable checks that u may search every directory down to dir: what a
// VM run as u needs of the directories above its state dir.
func Reachable(u User, dir string) error {
	return reachable(Spec{RunAs: &u}.credential(), dir, false)
}
