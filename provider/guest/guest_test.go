package guest

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

func TestRenderHistory(t *testing.T) {
	t0 := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	t1 := t0.Add(time.Minute)
	segs := []consoleSegment{
		{data: []byte("a1\na2\n"), modTime: t0},
		{data: []byte("b1\nb2\nb3 partial"), modTime: t1},
	}
	for _, tc := range []struct {
		name  string
		opts  api.ContainerLogOpts
		since time.Time
		want  string
	}{
		{"all", api.ContainerLogOpts{}, time.Time{}, "a1\na2\nb1\nb2\nb3 partial"},
		{"tail 2", api.ContainerLogOpts{Tail: 2}, time.Time{}, "b2\nb3 partial"},
		{"tail across files", api.ContainerLogOpts{Tail: 4}, time.Time{}, "a2\nb1\nb2\nb3 partial"},
		{"tail more than there is", api.ContainerLogOpts{Tail: 40}, time.Time{}, "a1\na2\nb1\nb2\nb3 partial"},
		{"since drops older file", api.ContainerLogOpts{}, t0.Add(time.Second), "b1\nb2\nb3 partial"},
		{"since after everything", api.ContainerLogOpts{}, t1.Add(time.Second), ""},
		{"timestamps are file mtimes", api.ContainerLogOpts{Timestamps: true, Tail: 4}, time.Time{},
			"2026-01-02T03:04:05Z a2\n2026-01-02T03:05:05Z b1\n2026-01-02T03:05:05Z b2\n2026-01-02T03:05:05Z b3 partial"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := string(renderHistory(segs, tc.opts, tc.since))
			// the partial last line appears with its stamp only once
			if tc.opts.Timestamps {
				assert.Equal(t, strings.Count(tc.want, "2026-"), strings.Count(got, "2026-"))
			}
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestTailStart(t *testing.T) {
	seg := func(ss ...string) []consoleSegment {
		var out []consoleSegment
		for _, s := range ss {
			out = append(out, consoleSegment{data: []byte(s)})
		}
		return out
	}
	render := func(segs []consoleSegment, n int) string {
		return string(renderHistory(segs, api.ContainerLogOpts{Tail: n}, time.Time{}))
	}
	for _, tc := range []struct {
		segs []consoleSegment
		n    int
		want string
	}{
		{seg("\n\nx\n"), 1, "x\n"},
		{seg("\n\nx\n"), 2, "\nx\n"},
		{seg("\n\nx\n"), 3, "\n\nx\n"},
		{seg("\n\nx\n"), 9, "\n\nx\n"},
		{seg("a\nb", "c\n"), 2, "bc\n"}, // a line does not span files
		{seg("a\nb", "c\n"), 3, "a\nbc\n"},
		{seg("a\n", ""), 1, "a\n"},
		{seg("", ""), 1, ""},
	} {
		assert.Equal(t, tc.want, render(tc.segs, tc.n), "%q tail %d", tc.segs, tc.n)
	}
}

func TestLogSince(t *testing.T) {
	now := time.Date(2026, 1, 1, 0, 0, 10, 0, time.UTC)
	assert.Equal(t, now.Add(-5*time.Second), logSince(api.ContainerLogOpts{SinceSeconds: 5}, now))
	at := now.Add(-time.Hour)
	assert.Equal(t, at, logSince(api.ContainerLogOpts{SinceTime: at}, now))
	assert.True(t, logSince(api.ContainerLogOpts{}, now).IsZero())
}

func TestLimitAndStampWriters(t *testing.T) {
	var buf bytes.Buffer
	lw := &limitWriter{w: &buf, left: 5}
	n, err := lw.Write([]byte("abc"))
	assert.Equal(t, 3, n)
	require.NoError(t, err)
	n, err = lw.Write([]byte("defg"))
	assert.Equal(t, 2, n)
	assert.ErrorIs(t, err, errLimitReached)
	_, err = lw.Write([]byte("x"))
	assert.ErrorIs(t, err, errLimitReached)
	assert.Equal(t, "abcde", buf.String())

	buf.Reset()
	at := time.Date(2026, 5, 6, 7, 8, 9, 500, time.UTC)
	sw := &stampWriter{w: &buf, stamp: true, now: func() time.Time { return at }, atStart: true}
	_, err = sw.Write([]byte("one\ntw"))
	require.NoError(t, err)
	_, err = sw.Write([]byte("o\nthree\n"))
	require.NoError(t, err)
	ts := "2026-05-06T07:08:09.0000005Z "
	assert.Equal(t, ts+"one\n"+ts+"two\n"+ts+"three\n", buf.String())
}

// WriteConsole fakes a pod state dir's console files with given mtimes.
func writeConsole(t *testing.T, dir, name, content string, mtime time.Time) {
	t.Helper()
	p := filepath.Join(dir, name)
	require.NoError(t, os.WriteFile(p, []byte(content), 0o600))
	require.NoError(t, os.Chtimes(p, mtime, mtime))
}

func TestConsoleLogsFiles(t *testing.T) {
	dir := t.TempDir()
	old := time.Now().Add(-time.Hour)
	writeConsole(t, dir, ConsoleRotatedName, "rot1\nrot2\n", old)
	writeConsole(t, dir, qemu.ConsoleLogName, "cur1\ncur2\n", time.Now())
	read := func(opts api.ContainerLogOpts) (string, error) {
		rc, err := ConsoleLogs(context.Background(), ConsoleLogSource{Dir: dir, Pod: "ns/p"}, opts)
		if err != nil {
			return "", err
		}
		defer rc.Close()
		b, err := io.ReadAll(rc)
		return string(b), err
	}
	got, err := read(api.ContainerLogOpts{})
	require.NoError(t, err)
	assert.Equal(t, "rot1\nrot2\ncur1\ncur2\n", got)
	got, err = read(api.ContainerLogOpts{SinceSeconds: 60})
	require.NoError(t, err)
	assert.Equal(t, "cur1\ncur2\n", got)
	got, err = read(api.ContainerLogOpts{LimitBytes: 7})
	require.NoError(t, err)
	assert.Equal(t, "rot1\nro", got)
	// Follow without a live VM returns what is kept.
	got, err = read(api.ContainerLogOpts{Follow: true, Tail: 1})
	require.NoError(t, err)
	assert.Equal(t, "cur2\n", got)

	_, err = read(api.ContainerLogOpts{Previous: true})
	require.Error(t, err)
	assert.True(t, errdefs.IsNotFound(err), "previous without a previous run is NotFound: %v", err)
	assert.Contains(t, err.Error(), "ns/p")
	writeConsole(t, dir, qemu.ConsolePreviousLogName, "prev\n", old)
	got, err = read(api.ContainerLogOpts{Previous: true})
	require.NoError(t, err)
	assert.Equal(t, "prev\n", got)
}

func TestConsoleLogsFollow(t *testing.T) {
	dir := t.TempDir()
	writeConsole(t, dir, qemu.ConsoleLogName, "before\n", time.Now())
	done := make(chan struct{})
	rc, err := ConsoleLogs(context.Background(), ConsoleLogSource{Dir: dir, Done: done, Pod: "ns/p"}, api.ContainerLogOpts{Follow: true})
	require.NoError(t, err)
	defer rc.Close()
	f, err := os.OpenFile(filepath.Join(dir, qemu.ConsoleLogName), os.O_APPEND|os.O_WRONLY, 0)
	require.NoError(t, err)
	_, err = f.WriteString("after\n")
	require.NoError(t, err)
	f.Close()
	buf := make([]byte, 64)
	var got []byte
	for !bytes.Contains(got, []byte("after\n")) {
		n, err := rc.Read(buf)
		require.NoError(t, err)
		got = append(got, buf[:n]...)
	}
	assert.Equal(t, "before\nafter\n", string(got))
	close(done) // the VM exited: the stream ends
	rest, err := io.ReadAll(rc)
	require.NoError(t, err)
	assert.Empty(t, rest)
}

func TestConsoleWriterLock(t *testing.T) {
	dir := t.TempDir()
	rel, err := LockConsoleWriter(dir)
	require.NoError(t, err)
	_, err = LockConsoleWriter(dir)
	assert.ErrorIs(t, err, ErrConsoleBusy)
	rel()
	rel2, err := LockConsoleWriter(dir)
	require.NoError(t, err, "the lock is free again once released")
	rel2()
}

// usernetSample is QEMU 7.2's `info usernet` (captured): a forward whose
// guest has not answered yet (18931), and one connection the guest accepted
// (18932).
const usernetSample = `Hub -1 (net0):
  Protocol[State]    FD  Source Address  Port   Dest. Address  Port RecvQ SendQ
  TCP[SYN_SENT]      12       127.0.0.1 18931       10.0.2.15  9999     0     0
  TCP[ESTABLISHED]   13       127.0.0.1 18932       10.0.2.15  8080     0     0
  TCP[FIN_WAIT_2]    14       127.0.0.1 18933       10.0.2.15  8080     0     0
  TCP[HOST_FORWARD]   9       127.0.0.1 18931       10.0.2.15  9999     0     0
  TCP[HOST_FORWARD]   8       127.0.0.1 18932       10.0.2.15  8080     0     0
  TCP[HOST_FORWARD]   7       127.0.0.1 18933       10.0.2.15  8080     0     0
`

func TestGuestAccepted(t *testing.T) {
	assert.False(t, guestAccepted(usernetSample, 18931), "SYN_SENT: no answer yet")
	assert.True(t, guestAccepted(usernetSample, 18932))
	assert.False(t, guestAccepted(usernetSample, 18933), "only an old closing connection")
	assert.False(t, guestAccepted(usernetSample, 1893), "port must match exactly")
	assert.False(t, guestAccepted("", 18932))
}

func TestAwaitGuest(t *testing.T) {
	ctx := context.Background()
	fixed := func(out string) UsernetQuery {
		return func(context.Context) (string, error) { return out, nil }
	}
	// QEMU closes the host side: the guest refused.
	a, b := testutil.TCPPair(t)
	b.Close()
	_, err := AwaitGuest(ctx, fixed(usernetSample), a, 18931, 2*time.Second)
	assert.ErrorIs(t, err, ErrGuestPortClosed)

	// Still SYN_SENT at the deadline: no answer.
	a, _ = testutil.TCPPair(t)
	_, err = AwaitGuest(ctx, fixed(usernetSample), a, 18931, 200*time.Millisecond)
	assert.ErrorIs(t, err, ErrGuestNoAnswer)

	// Established: accepted, nothing read.
	a, b = testutil.TCPPair(t)
	got, err := AwaitGuest(ctx, fixed(usernetSample), a, 18932, time.Second)
	require.NoError(t, err)
	assert.Empty(t, got)

	// The guest answers after a while, first with a greeting: kept.
	a, b = testutil.TCPPair(t)
	calls := 0
	later := func(context.Context) (string, error) {
		calls++
		if calls == 3 {
			_, _ = b.Write([]byte("SSH-2.0-x\r\n"))
		}
		return usernetSample, nil
	}
	got, err = AwaitGuest(ctx, later, a, 18931, 5*time.Second)
	require.NoError(t, err)
	assert.Equal(t, "SSH-2.0-x\r\n", string(got))

	// QEMU cannot be asked: an error naming that.
	a, _ = testutil.TCPPair(t)
	_, err = AwaitGuest(ctx, func(context.Context) (string, error) { return "", errors.New("QMP gone") }, a, 1, time.Second)
	assert.ErrorContains(t, err, "ask QEMU for the connection state: QMP gone")
}

// TestConsoleWriterLockShared: a lease's console sessions share the
// writer lock; kubectl attach -i (exclusive) is refused beside them and
// refuses them.
func TestConsoleWriterLockShared(t *testing.T) {
	dir := t.TempDir()
	s1, err := ShareConsoleWriter(dir)
	require.NoError(t, err)
	s2, err := ShareConsoleWriter(dir)
	require.NoError(t, err, "sessions share the lock")
	_, err = LockConsoleWriter(dir)
	assert.ErrorIs(t, err, ErrConsoleBusy)
	s1()
	_, err = LockConsoleWriter(dir)
	assert.ErrorIs(t, err, ErrConsoleBusy, "one session still holds it")
	s2()
	ex, err := LockConsoleWriter(dir)
	require.NoError(t, err)
	_, err = ShareConsoleWriter(dir)
	assert.ErrorIs(t, err, ErrConsoleHeldByAttach)
	ex()
}
