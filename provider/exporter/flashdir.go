package exporter

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// The flash dir lives in the pod's state dir, where QEMU's user may
// create entries (the state dir is group-writable and sticky: see package
// qemu's handOver). The agent runs as root, so it never follows a link
// there: the dir is made when the pod is recorded, before QEMU first
// runs (MakeFlashDir), so QEMU's user can neither make nor replace it;
// it is opened with O_NOFOLLOW and must be a directory the agent owns
// that no one else may write, and every file in it is made, renamed and
// opened relative to that open dir, never by a path a link could
// redirect.

// MakeFlashDir makes the flash dir of the pod with state dir dir (if it
// is not there yet) and checks it. The pod's worker calls it before
// QEMU first runs.
func MakeFlashDir(dir string) error {
	d, err := openFlashDir(dir)
	if err != nil {
		return err
	}
	return d.Close()
}

// openFlashDir makes (if need be) and opens the flash dir of dir.
func openFlashDir(dir string) (*os.File, error) {
	path := filepath.Join(dir, FlashDirName)
	// mkdir(2) never follows a link in its last component: a planted
	// link makes it EEXIST, and the open below refuses it.
	if err := unix.Mkdir(path, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("flash dir %s: %w", path, err)
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return nil, fmt.Errorf("flash dir %s is not a directory (a link or file planted in the VM's dir?): refused", path)
		}
		return nil, fmt.Errorf("flash dir %s: %w", path, err)
	}
	d := os.NewFile(uintptr(fd), path)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		d.Close()
		return nil, fmt.Errorf("flash dir %s: %w", path, err)
	}
	if int(st.Uid) != os.Geteuid() || st.Mode&0o022 != 0 {
		d.Close()
		return nil, fmt.Errorf("flash dir %s is owned by uid %d with mode %o, not the agent's alone: refused", path, st.Uid, st.Mode&0o7777)
	}
	return d, nil
}

// createIn makes a new file named prefix+random in the open dir d
// (O_EXCL, O_NOFOLLOW), for writing.
func createIn(d *os.File, prefix string) (*os.File, error) {
	for range 10 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		name := prefix + hex.EncodeToString(b[:])
		fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if errors.Is(err, unix.EEXIST) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", filepath.Join(d.Name(), name), err)
		}
		return os.NewFile(uintptr(fd), filepath.Join(d.Name(), name)), nil
	}
	return nil, fmt.Errorf("create a file in %s: no free name", d.Name())
}

// openIn opens the regular file name of the open dir d for reading,
// never through a link.
func openIn(d *os.File, name string) (*os.File, error) {
	fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", filepath.Join(d.Name(), name), err)
	}
	f := os.NewFile(uintptr(fd), filepath.Join(d.Name(), name))
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("open %s: not a regular file", f.Name())
	}
	return f, nil
}

// renameIn renames from to to within the open dir d.
func renameIn(d *os.File, from, to string) error {
	if err := unix.Renameat(int(d.Fd()), from, int(d.Fd()), to); err != nil {
		return fmt.Errorf("rename %s to %s in %s: %w", from, to, d.Name(), err)
	}
	return nil
}

// removeIn removes name from the flash dir of dir (best effort: a flash
// that failed leaves no file behind).
func removeIn(dir, name string) {
	d, err := openFlashDir(dir)
	if err != nil {
		return
	}
	defer d.Close()
	_ = unix.Unlinkat(int(d.Fd()), name, 0)
}
