package exporter

import (
	"fmt"
	"sync"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter"
	"golang.org/x/sys/unix"
)

// Disk space of flashes in progress. A point-in-time look at the free
// space lets concurrent flashes each count on all of it; instead every
// flash holds the space it writes, taken as it goes (diskChunk at a
// time, less as room runs short) from what the file system has free less
// the node's reserve less
// what the other flashes in progress hold. Flashes share the disk as
// they come, together never writing into the reserve; one that finds no
// room left fails with the reason, and its file goes. A flash's hold ends
// with it (its bytes are then on the disk, in the free space every later
// check reads). The node's ledger (one per agent process, as the disk is
// the node's) owns the holds; its mutex guards them.

// diskChunk is how much a flash takes from the ledger at a time.
const diskChunk = 64 << 20

// spaceLedger holds the disk space of flashes in progress, by file system.
type spaceLedger struct {
	// statfs reads a file system's identity and free bytes (tests fake
	// it).
	statfs func(path string) (fs [2]int32, free int64, err error)

	mu   sync.Mutex
	held map[[2]int32]int64
}

func statfsFree(path string) ([2]int32, int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return [2]int32{}, 0, fmt.Errorf("free space of %s: %w", path, err)
	}
	return st.Fsid.Val, int64(st.Bavail) * int64(st.Bsize), nil
}

// nodeDisk is the agent's ledger.
var nodeDisk = &spaceLedger{statfs: statfsFree, held: map[[2]int32]int64{}}

// available is what a new hold may take on path's file system: its free
// space less reserve less what flashes in progress hold there.
func (l *spaceLedger) available(path string, reserve int64) (int64, error) {
	fs, free, err := l.statfs(path)
	if err != nil {
		return 0, err
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return free - reserve - l.held[fs], nil
}

// diskHold is one flash's hold on the ledger; its writer owns it.
type diskHold struct {
	l       *spaceLedger
	path    string
	reserve int64
	fs      [2]int32
	left    int64 // taken and not yet written
	written int64 // written since the last take (on disk now)
}

// hold opens a hold for a flash writing on path's file system.
func (l *spaceLedger) hold(path string, reserve int64) *diskHold {
	return &diskHold{l: l, path: path, reserve: reserve}
}

// use counts n bytes about to be written, taking more from the ledger
// when the hold has not enough left.
func (h *diskHold) use(n int64) error {
	if h == nil {
		return nil
	}
	if h.left < n {
		fs, free, err := h.l.statfs(h.path)
		if err != nil {
			return err
		}
		need := n - h.left
		h.l.mu.Lock()
		h.l.held[fs] -= h.written // written bytes are in free now
		h.written = 0
		h.fs = fs
		room := free - h.reserve - h.l.held[fs]
		// A chunk, less when room runs short (others may need some too),
		// never less than this write.
		want := max(need, min(diskChunk, room/4))
		if room < want {
			others := h.l.held[fs] - h.left
			h.l.mu.Unlock()
			return fmt.Errorf("%w: the node's disk has no room left for the image (%d MiB free, %d MiB kept in reserve, %d MiB held by other flashes in progress)",
				jumpstarter.ErrInvalidArgument, free>>20, h.reserve>>20, others>>20)
		}
		h.l.held[fs] += want
		h.l.mu.Unlock()
		h.left += want
	}
	h.left -= n
	h.written += n
	return nil
}

// release ends the hold (idempotent).
func (h *diskHold) release() {
	if h == nil {
		return
	}
	h.l.mu.Lock()
	h.l.held[h.fs] -= h.left + h.written
	if h.l.held[h.fs] == 0 {
		delete(h.l.held, h.fs)
	}
	h.l.mu.Unlock()
	h.left, h.written = 0, 0
}
