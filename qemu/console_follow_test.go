package qemu

import (
	"bytes"
	"context"
	"encoding/binary"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// syncBuf is a writer the test reads while FollowConsole writes; got
// signals every write.
type syncBuf struct {
	mu  sync.Mutex
	b   bytes.Buffer
	got chan struct{}
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.Write(p)
	select {
	case s.got <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// waitFor waits until the buffer holds want (10 s: a loaded machine).
func (s *syncBuf) waitFor(t *testing.T, want string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for s.String() != want {
		select {
		case <-s.got:
		case <-deadline:
			t.Fatalf("followed %q, want %q", s.String(), want)
		}
	}
}

// TestFollowConsoleWokenByWrites: with the poll made useless (an hour),
// FollowConsole still delivers every write, a truncation (rotation) and the
// writes after it: inotify wakes it.
func TestFollowConsoleWokenByWrites(t *testing.T) {
	saved := followPollInterval
	followPollInterval = time.Hour
	t.Cleanup(func() { followPollInterval = saved })
	dir := t.TempDir()
	f, err := os.OpenFile(filepath.Join(dir, ConsoleLogName), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	f.WriteString("history\n")
	out := &syncBuf{got: make(chan struct{}, 1)}
	done := make(chan struct{})
	errc := make(chan error, 1)
	from := ConsoleSize(dir)
	go func() { errc <- FollowConsole(context.Background(), dir, from, done, out) }()
	// Other files of the state dir do not matter.
	os.WriteFile(filepath.Join(dir, "status.json"), []byte("{}"), 0o600)
	f.WriteString("live-1\n")
	out.waitFor(t, "live-1\n")
	f.WriteString("live-2\n")
	out.waitFor(t, "live-1\nlive-2\n")
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	f.WriteString("rotated\n")
	out.waitFor(t, "live-1\nlive-2\nrotated\n")
	close(done)
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
}

// TestFollowConsolePollsWithoutInotify: a state dir inotify cannot watch
// (not there yet when the follow begins) is polled.
func TestFollowConsolePollsWithoutInotify(t *testing.T) {
	saved := followPollInterval
	followPollInterval = 10 * time.Millisecond
	t.Cleanup(func() { followPollInterval = saved })
	dir := filepath.Join(t.TempDir(), "later")
	if _, _, err := watchFile(dir, ConsoleLogName); err == nil {
		t.Fatal("watchFile of a missing dir succeeded")
	}
	out := &syncBuf{got: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() { errc <- FollowConsole(ctx, dir, 0, nil, out) }()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ConsoleLogName), []byte("polled\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	out.waitFor(t, "polled\n")
	cancel()
	if err := <-errc; err != context.Canceled {
		t.Fatalf("FollowConsole after cancel: %v", err)
	}
}

// TestInotifyNames: events naming the file (or an overflow) wake the
// follower; others do not.
func TestInotifyNames(t *testing.T) {
	ev := func(mask uint32, name string) []byte {
		n := len(name)
		if n > 0 {
			n = (n + 1 + 15) / 16 * 16 // NUL-padded, as the kernel does
		}
		b := make([]byte, unix.SizeofInotifyEvent+n)
		binary.NativeEndian.PutUint32(b[0:4], 1)
		binary.NativeEndian.PutUint32(b[4:8], mask)
		binary.NativeEndian.PutUint32(b[12:16], uint32(n))
		copy(b[unix.SizeofInotifyEvent:], name)
		return b
	}
	cat := func(bs ...[]byte) []byte { return bytes.Join(bs, nil) }
	for _, c := range []struct {
		name string
		buf  []byte
		want bool
	}{
		{"console", ev(unix.IN_MODIFY, ConsoleLogName), true},
		{"other", ev(unix.IN_MODIFY, "status.json"), false},
		{"prefix", ev(unix.IN_MODIFY, ConsoleLogName+".1"), false},
		{"second", cat(ev(unix.IN_CREATE, "x"), ev(unix.IN_MOVED_TO, ConsoleLogName)), true},
		{"overflow", ev(unix.IN_Q_OVERFLOW, ""), true},
		{"cut", ev(unix.IN_MODIFY, "status.json")[:unix.SizeofInotifyEvent+2], true},
		{"empty", nil, false},
	} {
		if got := inotifyNames(c.buf, ConsoleLogName); got != c.want {
			t.Errorf("%s: inotifyNames = %v, want %v", c.name, got, c.want)
		}
	}
}
