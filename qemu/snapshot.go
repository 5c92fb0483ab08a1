package qemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Saving and restoring a VM's state (memory snapshots).
//
// SaveState pauses the guest, has QEMU migrate its memory and device state
// to a unix socket in the state dir (QEMU 7.2 has no file: migration and
// the sandbox forbids exec:), writes what arrives to a temporary file next
// to the destination, fsyncs and renames it, runs the caller's whileStopped
// (e.g. to copy the disk as it is at that instant: the migration flushed
// it) and resumes the guest. A VM is restored with Spec.Incoming.
//
// The saved state holds no disk content: a restored VM must get disks with
// the content they had when the state was saved.

// SavedState describes a state written by SaveState.
type SavedState struct {
	Bytes int64
	// Paused is how long the guest was paused (the save and whileStopped).
	Paused time.Duration
}

// pollMigration is how often SaveState and a restore ask QEMU how far it is.
const pollMigration = 20 * time.Millisecond

// SaveState writes the VM's memory and device state to path (see above).
// The guest is paused for the whole save; it runs again afterwards if it
// ran before, also when the save failed. Nothing is left at path on error.
func (vm *VM) SaveState(ctx context.Context, path string, whileStopped func() error) (SavedState, error) {
	var res SavedState
	fail := func(err error) (SavedState, error) {
		return res, fmt.Errorf("save state of VM %s: %w", vm.spec.Name, err)
	}
	sock := vm.spec.Path(MigrateSocketName)
	_ = os.Remove(sock)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return fail(err)
	}
	defer os.Remove(sock)
	defer ln.Close()
	if u := vm.spec.RunAs; u != nil {
		if err := os.Lchown(sock, int(u.UID), int(u.GID)); err != nil {
			return fail(err)
		}
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fail(err)
	}
	defer os.Remove(tmp.Name()) // no-op once renamed
	defer tmp.Close()

	// Receive: one connection, copied to tmp until QEMU closes it.
	type copied struct {
		n   int64
		err error
	}
	recv := make(chan copied, 1)
	go func() {
		dl := time.Now().Add(30 * time.Second)
		if d, ok := ctx.Deadline(); ok {
			dl = d
		}
		_ = ln.SetDeadline(dl)
		c, err := ln.Accept()
		if err != nil {
			recv <- copied{err: fmt.Errorf("QEMU did not connect to %s: %w", sock, err)}
			return
		}
		defer c.Close()
		n, err := io.Copy(tmp, c)
		recv <- copied{n, err}
	}()

	st, err := vm.queryStatus(ctx)
	if err != nil {
		return fail(err)
	}
	wasRunning := st == "running"
	began := time.Now()
	resume := func() error {
		if !wasRunning {
			return nil
		}
		// A resume must not be skipped because ctx ended.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		err := vm.QMP(rctx, "cont", nil, nil)
		res.Paused = time.Since(began)
		return err
	}
	if wasRunning {
		if err := vm.QMP(ctx, "stop", nil, nil); err != nil {
			return fail(err)
		}
	}
	if err := vm.migrate(ctx, "unix:"+sock); err != nil {
		ln.Close() // ends a pending Accept
		return fail(errors.Join(err, resume()))
	}
	var got copied
	select {
	case got = <-recv:
	case <-ctx.Done():
		ln.Close()
		got = copied{err: ctx.Err()}
	}
	if got.err == nil {
		got.err = tmp.Sync()
	}
	if got.err == nil {
		got.err = tmp.Close()
	}
	if got.err == nil && whileStopped != nil {
		got.err = whileStopped()
	}
	if err := errors.Join(got.err, resume()); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fail(err)
	}
	if err := syncDir(filepath.Dir(path)); err != nil {
		os.Remove(path)
		return fail(err)
	}
	res.Bytes = got.n
	return res, nil
}

// migrate starts a migration to uri and waits until QEMU says it completed
// (or failed, or ctx ended: then it is cancelled).
func (vm *VM) migrate(ctx context.Context, uri string) error {
	if err := vm.QMP(ctx, "migrate", map[string]any{"uri": uri}, nil); err != nil {
		return err
	}
	for {
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := vm.QMP(ctx, "query-migrate", nil, &st); err != nil {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = vm.QMP(cctx, "migrate_cancel", nil, nil)
			cancel()
			return err
		}
		switch st.Status {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", st.Status, st.ErrorDesc)
		}
		if !sleepCtx(ctx, pollMigration) {
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = vm.QMP(cctx, "migrate_cancel", nil, nil)
			cancel()
			return fmt.Errorf("migration: %w", ctx.Err())
		}
	}
}

// finishIncoming waits until QEMU loaded the state of Spec.Incoming and
// lets the guest run: the state of a guest paused for the save loads as
// paused. QEMU exits when the state cannot be loaded (bad file, other VM).
func (vm *VM) finishIncoming(ctx context.Context) error {
	for {
		st, err := vm.queryStatus(ctx)
		if err != nil {
			select {
			case <-vm.childDone:
				vm.mu.Lock()
				ps := vm.childStatus
				vm.mu.Unlock()
				return fmt.Errorf("restore from %s: QEMU exited while loading the state (%s)", vm.spec.Incoming, ps)
			case <-time.After(5 * time.Second):
			}
			return fmt.Errorf("restore from %s: %w", vm.spec.Incoming, err)
		}
		switch st {
		case "inmigrate":
		case "running":
			return nil
		case "paused", "postmigrate", "prelaunch":
			if err := vm.QMP(ctx, "cont", nil, nil); err != nil {
				return fmt.Errorf("restore from %s: resume: %w", vm.spec.Incoming, err)
			}
			return nil
		default:
			return fmt.Errorf("restore from %s: QEMU is %q after loading the state", vm.spec.Incoming, st)
		}
		if !sleepCtx(ctx, pollMigration) {
			return fmt.Errorf("restore from %s: %w", vm.spec.Incoming, ctx.Err())
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
