package guest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/qemu-kubelet/qemu-kubelet/qemu"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
)

// `kubectl logs` of a VM pod is its serial console, as QEMU writes it to
// console.log in the pod's state dir (console.log.1 holds the older half
// after a rotation; console.previous.log is the previous run). The files
// survive qemu-kubelet restarts.
//
// QEMU's log file has no timestamps, so --timestamps and --since are
// approximations, documented in docs/kubelet-api.md:
//   - a line already in a file is stamped with that file's modification
//     time: an upper bound of when it was written (exact for the last line);
//   - a line that arrives while following is stamped with its arrival time;
//   - --since drops a whole file whose modification time is before the
//     since time (nothing in it can be newer); a file modified after it is
//     shown whole (its older lines cannot be told apart).
//
// --tail 0 cannot be told from "no --tail" (the library parses both to 0),
// so it shows everything.

// ConsoleRotatedName is package qemu's rotated generation of console.log.
const ConsoleRotatedName = qemu.ConsoleLogName + ".1"

// consoleSegment is one console file's content and modification time.
type consoleSegment struct {
	data    []byte
	modTime time.Time
}

// logSince is the since time of opts (zero: none).
func logSince(opts api.ContainerLogOpts, now time.Time) time.Time {
	if opts.SinceSeconds > 0 {
		return now.Add(-time.Duration(opts.SinceSeconds) * time.Second)
	}
	return opts.SinceTime
}

// formatStamp is the kubelet's timestamp prefix (RFC3339Nano, UTC).
func formatStamp(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) + " " }

// renderHistory applies since, tail and timestamps to the kept console
// files (oldest first). A line does not span files. Pure; only the lines
// shown are looked at.
func renderHistory(segs []consoleSegment, opts api.ContainerLogOpts, since time.Time) []byte {
	kept := make([]consoleSegment, 0, len(segs))
	for _, s := range segs {
		if len(s.data) > 0 && (since.IsZero() || !s.modTime.Before(since)) {
			kept = append(kept, s)
		}
	}
	// Where the shown part starts: file first, offset off.
	first, off := 0, 0
	if opts.Tail > 0 {
		first, off = tailStart(kept, opts.Tail)
	}
	var out bytes.Buffer
	for i := first; i < len(kept); i++ {
		d := kept[i].data
		if i == first {
			d = d[off:]
		}
		if !opts.Timestamps {
			out.Write(d)
			continue
		}
		stamp := formatStamp(kept[i].modTime)
		for len(d) > 0 {
			j := bytes.IndexByte(d, '\n') + 1
			if j == 0 {
				j = len(d)
			}
			out.WriteString(stamp)
			out.Write(d[:j])
			d = d[j:]
		}
	}
	return out.Bytes()
}

// tailStart finds the start of the last n lines of segs: the file index
// and the offset in it (0, 0 when there are fewer lines).
func tailStart(segs []consoleSegment, n int) (int, int) {
	for i := len(segs) - 1; i >= 0; i-- {
		d := segs[i].data
		for p := len(d); p > 0; {
			// The line holding byte p-1 starts after the newline before it.
			start := bytes.LastIndexByte(d[:p-1], '\n') + 1
			n--
			if n == 0 {
				return i, start
			}
			p = start
		}
	}
	return 0, 0
}

// readSegment reads one console file; a missing file is empty.
func readSegment(path string) (consoleSegment, error) {
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return consoleSegment{}, nil
	}
	if err != nil {
		return consoleSegment{}, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return consoleSegment{}, err
	}
	b, err := io.ReadAll(f)
	if err != nil {
		return consoleSegment{}, err
	}
	return consoleSegment{data: b, modTime: fi.ModTime()}, nil
}

// ConsoleLogSource says where a pod's console is and whether it is live.
type ConsoleLogSource struct {
	// Dir is the pod's state dir.
	Dir string
	// Done is closed when the running VM exits; nil when no VM runs (then
	// --follow returns what is kept).
	Done <-chan struct{}
	// Pod names the pod in errors ("namespace/name").
	Pod string
	// Now is the clock (default time.Now).
	Now func() time.Time
}

// ConsoleLogs returns the console as `kubectl logs` asks for it. With
// Follow and a live VM it streams new output until ctx ends, the reader is
// closed or the VM exits.
func ConsoleLogs(ctx context.Context, src ConsoleLogSource, opts api.ContainerLogOpts) (io.ReadCloser, error) {
	now := time.Now
	if src.Now != nil {
		now = src.Now
	}
	since := logSince(opts, now())
	var segs []consoleSegment
	names := []string{ConsoleRotatedName, qemu.ConsoleLogName}
	if opts.Previous {
		names = []string{qemu.ConsolePreviousLogName}
		if _, err := os.Stat(filepath.Join(src.Dir, qemu.ConsolePreviousLogName)); errors.Is(err, os.ErrNotExist) {
			return nil, errdefs.NotFoundf("previous terminated VM of pod %s not found (the VM has not been restarted)", src.Pod)
		}
	}
	for _, n := range names {
		s, err := readSegment(filepath.Join(src.Dir, n))
		if err != nil {
			return nil, fmt.Errorf("logs of pod %s: read %s: %w", src.Pod, n, err)
		}
		segs = append(segs, s)
	}
	// Follow continues in console.log right after what was read of it.
	offset := int64(len(segs[len(segs)-1].data))
	hist := renderHistory(segs, opts, since)

	pr, pw := io.Pipe()
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		defer cancel()
		var w io.Writer = pw
		if opts.LimitBytes > 0 {
			w = &limitWriter{w: pw, left: int64(opts.LimitBytes)}
		}
		_, err := w.Write(hist)
		if err == nil && opts.Follow && !opts.Previous && src.Done != nil {
			lw := &stampWriter{w: w, stamp: opts.Timestamps, now: now, atStart: len(hist) == 0 || hist[len(hist)-1] == '\n'}
			err = qemu.FollowConsole(ctx, src.Dir, offset, src.Done, lw)
		}
		if errors.Is(err, errLimitReached) || errors.Is(err, context.Canceled) {
			err = nil
		}
		pw.CloseWithError(err)
	}()
	return &cancelReader{PipeReader: pr, cancel: cancel}, nil
}

type cancelReader struct {
	*io.PipeReader
	cancel context.CancelFunc
}

func (c *cancelReader) Close() error {
	c.cancel()
	return c.PipeReader.Close()
}

var errLimitReached = errors.New("log byte limit reached")

// limitWriter passes at most left bytes, then fails with errLimitReached.
type limitWriter struct {
	w    io.Writer
	left int64
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if l.left <= 0 {
		return 0, errLimitReached
	}
	cut := p
	if int64(len(cut)) > l.left {
		cut = cut[:l.left]
	}
	n, err := l.w.Write(cut)
	l.left -= int64(n)
	if err == nil && len(cut) < len(p) {
		err = errLimitReached
	}
	return n, err
}

// stampWriter prefixes each line with its arrival time when stamp is set.
type stampWriter struct {
	w       io.Writer
	stamp   bool
	now     func() time.Time
	atStart bool
}

func (s *stampWriter) Write(p []byte) (int, error) {
	if !s.stamp {
		return s.w.Write(p)
	}
	var out bytes.Buffer
	ts := formatStamp(s.now())
	for _, c := range p {
		if s.atStart {
			out.WriteString(ts)
			s.atStart = false
		}
		out.WriteByte(c)
		if c == '\n' {
			s.atStart = true
		}
	}
	if _, err := s.w.Write(out.Bytes()); err != nil {
		return 0, err
	}
	return len(p), nil
}
