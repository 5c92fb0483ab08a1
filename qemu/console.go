package qemu

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// The serial console is written by QEMU itself to console.log in the state
// dir (chardev logfile, logappend=on), so output is kept while nobody
// supervises the VM. QEMU does not cap that file, so the supervisor does:
// every consoleCapCheckInterval it checks the size and, when console.log
// exceeds half the cap, copies it to console.log.1 and truncates it in place
// (QEMU opened it O_APPEND, so it keeps writing at the new end). The two
// files together stay near the cap. Bytes QEMU writes between the copy and
// the truncate (microseconds) are lost; while the VM is unsupervised the
// file grows uncapped until the next Adopt. Readers read console.log.1 then
// console.log.
const (
	// DefaultConsoleCap bounds console.log + console.log.1.
	DefaultConsoleCap       int64 = 8 << 20
	consoleCapCheckInterval       = 5 * time.Second
	// ConsolePreviousLogName is the console of the previous run in the same
	// state dir (Start renames console.log to it).
	ConsolePreviousLogName = "console.previous.log"
	consoleRotatedSuffix   = ".1"
)

// followPollInterval is how often a follower looks at console.log where
// inotify cannot tell it (a variable for tests).
var followPollInterval = 200 * time.Millisecond

// capConsoleLog rotates console.log when it exceeds capBytes/2.
func capConsoleLog(stateDir string, capBytes int64) error {
	cur := filepath.Join(stateDir, ConsoleLogName)
	fi, err := os.Stat(cur)
	if err != nil || fi.Size() <= capBytes/2 {
		return nil
	}
	in, err := os.OpenFile(cur, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("open console log: %w", err)
	}
	defer in.Close()
	tmp := cur + consoleRotatedSuffix + ".tmp"
	out, err := os.OpenFile(tmp, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("rotate console log: %w", err)
	}
	// Keep at most capBytes/2 in the rotated generation.
	if fi.Size() > capBytes/2 {
		if _, err := in.Seek(fi.Size()-capBytes/2, io.SeekStart); err != nil {
			out.Close()
			return err
		}
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("rotate console log: %w", err)
	}
	if err := in.Truncate(0); err != nil {
		out.Close()
		return fmt.Errorf("truncate console log: %w", err)
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, cur+consoleRotatedSuffix)
}

// ReadConsole returns the whole kept console output of the current run.
func ReadConsole(stateDir string) ([]byte, error) {
	var buf bytes.Buffer
	for _, n := range []string{ConsoleLogName + consoleRotatedSuffix, ConsoleLogName} {
		b, err := os.ReadFile(filepath.Join(stateDir, n))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("read console: %w", err)
		}
		buf.Write(b)
	}
	return buf.Bytes(), nil
}

// TailConsole returns the last n lines of the console (all for n <= 0).
func TailConsole(stateDir string, n int) ([]byte, error) {
	b, err := ReadConsole(stateDir)
	if err != nil || n <= 0 {
		return b, err
	}
	end := len(b)
	if end > 0 && b[end-1] == '\n' {
		end--
	}
	i := end
	for lines := 0; i > 0; i-- {
		if b[i-1] == '\n' {
			lines++
			if lines == n {
				break
			}
		}
	}
	return b[i:], nil
}

// FollowConsole writes console output to w as it arrives, starting at byte
// offset from of the current console.log (use ConsoleSize for "from now"),
// until ctx ends or done is closed (then it drains what is left). It follows
// rotations (skipping what was written between its last read and the
// rotation).
//
// It is woken by the file growing (inotify on the state dir); where inotify
// is not available it polls every followPollInterval.
func FollowConsole(ctx context.Context, stateDir string, from int64, done <-chan struct{}, w io.Writer) error {
	cur := filepath.Join(stateDir, ConsoleLogName)
	off := from
	// Watch before the first read: nothing written after it is missed.
	wake, stopWatch, err := watchFile(stateDir, ConsoleLogName)
	var tick <-chan time.Time
	if err != nil {
		t := time.NewTicker(followPollInterval)
		defer t.Stop()
		tick = t.C
	} else {
		defer stopWatch()
	}
	final := false
	for {
		fi, err := os.Stat(cur)
		switch {
		case errors.Is(err, os.ErrNotExist):
		case err != nil:
			return fmt.Errorf("follow console: %w", err)
		default:
			if fi.Size() < off {
				// Rotated (or truncated): continue at the start of the new
				// file. Output written between our last read and the
				// rotation (at most one poll interval) is skipped.
				off = 0
			}
			if fi.Size() > off {
				f, err := os.Open(cur)
				if err != nil {
					return fmt.Errorf("follow console: %w", err)
				}
				_, err = f.Seek(off, io.SeekStart)
				if err == nil {
					var n int64
					n, err = io.Copy(w, f)
					off += n
				}
				f.Close()
				if err != nil {
					return fmt.Errorf("follow console: %w", err)
				}
			}
		}
		if final {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-done:
			final = true
		case <-tick:
		case <-wake:
		}
	}
}

// watchFile reports changes of the file name in dir (written, truncated,
// created or renamed there) on the returned channel (one pending signal:
// a reader looks at the file after each); stop ends the watch. An error
// means inotify cannot watch dir (the caller polls instead).
func watchFile(dir, name string) (<-chan struct{}, func(), error) {
	fd, err := unix.InotifyInit1(unix.IN_NONBLOCK | unix.IN_CLOEXEC)
	if err != nil {
		return nil, nil, fmt.Errorf("inotify: %w", err)
	}
	if _, err := unix.InotifyAddWatch(fd, dir, unix.IN_MODIFY|unix.IN_CREATE|unix.IN_MOVED_TO); err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("inotify watch %s: %w", dir, err)
	}
	// Non-blocking: the runtime's poller waits on it, and Close ends a
	// pending Read.
	f := os.NewFile(uintptr(fd), "inotify:"+dir)
	wake := make(chan struct{}, 1)
	go func() {
		buf := make([]byte, 16<<10)
		for {
			n, err := f.Read(buf)
			if err != nil {
				return // closed by stop
			}
			if inotifyNames(buf[:n], name) {
				select {
				case wake <- struct{}{}:
				default:
				}
			}
		}
	}()
	return wake, func() { f.Close() }, nil
}

// inotifyNames reports whether the inotify events in buf name name, or
// overflowed (something may have been missed). Pure.
func inotifyNames(buf []byte, name string) bool {
	for len(buf) >= unix.SizeofInotifyEvent {
		mask := binary.NativeEndian.Uint32(buf[4:8])
		l := int(binary.NativeEndian.Uint32(buf[12:16]))
		end := unix.SizeofInotifyEvent + l
		if end > len(buf) {
			return true // cut short: look at the file anyway
		}
		if mask&unix.IN_Q_OVERFLOW != 0 {
			return true
		}
		if n := string(bytes.TrimRight(buf[unix.SizeofInotifyEvent:end], "\x00")); n == name {
			return true
		}
		buf = buf[end:]
	}
	return false
}

// ConsoleSize is the current size of console.log (the offset for "follow
// from now").
func ConsoleSize(stateDir string) int64 {
	fi, err := os.Stat(filepath.Join(stateDir, ConsoleLogName))
	if err != nil {
		return 0
	}
	return fi.Size()
}

// Console returns the console output kept for this run.
func (vm *VM) Console() ([]byte, error) { return ReadConsole(vm.stateDir) }

// FollowConsole streams console output from offset from until ctx ends or
// the VM exits.
func (vm *VM) FollowConsole(ctx context.Context, from int64, w io.Writer) error {
	return FollowConsole(ctx, vm.stateDir, from, vm.done, w)
}

// AttachConsole returns a live, bidirectional stream of the serial console:
// reads return guest output from now on, writes are typed into the guest.
// Any number of attachments may be open at once: the VM holds one
// connection to QEMU's console socket (which serves a single client) and fans
// output out to every attachment; an attachment that does not keep up loses
// output rather than stalling the guest. Output still goes to console.log.
// Closing the last attachment closes the QEMU connection.
func (vm *VM) AttachConsole(ctx context.Context) (io.ReadWriteCloser, error) {
	vm.consoleMu.Lock()
	defer vm.consoleMu.Unlock()
	if vm.consoleConn == nil {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", vm.spec.Path(ConsoleSocketName))
		if err != nil {
			return nil, fmt.Errorf("attach console of VM %s: %w", vm.spec.Name, err)
		}
		vm.consoleConn = c
		vm.consoleClients = map[*consoleClient]struct{}{}
		go vm.consoleFanOut(c)
	}
	cl := &consoleClient{vm: vm, out: make(chan []byte, 256), closed: make(chan struct{})}
	vm.consoleClients[cl] = struct{}{}
	return cl, nil
}

// DialDisplay connects to the VNC server of a VM with a display
// (Spec.Display): RFB protocol bytes both ways. Each call is a new VNC
// client; QEMU serves several at once.
func (vm *VM) DialDisplay(ctx context.Context) (net.Conn, error) {
	if !vm.spec.Display {
		return nil, fmt.Errorf("display of VM %s: the VM has no display", vm.spec.Name)
	}
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", vm.spec.Path(VNCSocketName))
	if err != nil {
		return nil, fmt.Errorf("display of VM %s: %w", vm.spec.Name, err)
	}
	return c, nil
}

func (vm *VM) consoleFanOut(c net.Conn) {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			chunk := append([]byte(nil), buf[:n]...)
			vm.consoleMu.Lock()
			for cl := range vm.consoleClients {
				select {
				case cl.out <- chunk:
				default: // slow reader: drop rather than block the guest
				}
			}
			vm.consoleMu.Unlock()
		}
		if err != nil {
			vm.consoleMu.Lock()
			if vm.consoleConn == c {
				for cl := range vm.consoleClients {
					cl.closeLocked()
				}
				vm.consoleClients, vm.consoleConn = nil, nil
			}
			vm.consoleMu.Unlock()
			return
		}
	}
}

type consoleClient struct {
	vm      *VM
	out     chan []byte
	pending []byte
	closed  chan struct{}
	once    bool
}

func (cl *consoleClient) Read(p []byte) (int, error) {
	if len(cl.pending) == 0 {
		select {
		case b := <-cl.out:
			cl.pending = b
		case <-cl.closed:
			select {
			case b := <-cl.out:
				cl.pending = b
			default:
				return 0, io.EOF
			}
		}
	}
	n := copy(p, cl.pending)
	cl.pending = cl.pending[n:]
	return n, nil
}

func (cl *consoleClient) Write(p []byte) (int, error) {
	cl.vm.consoleMu.Lock()
	c := cl.vm.consoleConn
	_, attached := cl.vm.consoleClients[cl]
	cl.vm.consoleMu.Unlock()
	if c == nil || !attached {
		return 0, fmt.Errorf("console of VM %s: not attached", cl.vm.spec.Name)
	}
	return c.Write(p)
}

func (cl *consoleClient) closeLocked() {
	if !cl.once {
		cl.once = true
		close(cl.closed)
	}
}

func (cl *consoleClient) Close() error {
	vm := cl.vm
	vm.consoleMu.Lock()
	defer vm.consoleMu.Unlock()
	cl.closeLocked()
	if _, ok := vm.consoleClients[cl]; !ok {
		return nil
	}
	delete(vm.consoleClients, cl)
	if len(vm.consoleClients) == 0 && vm.consoleConn != nil {
		c := vm.consoleConn
		vm.consoleConn, vm.consoleClients = nil, nil
		return c.Close()
	}
	return nil
}

// WaitConsole waits until the console contains marker, the VM exits, or ctx
// ends. It polls the log file (for tests and readiness without a probe).
func (vm *VM) WaitConsole(ctx context.Context, marker string) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		b, err := vm.Console()
		if err != nil {
			return err
		}
		if bytes.Contains(b, []byte(marker)) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for %q on the console of VM %s: %w", marker, vm.spec.Name, ctx.Err())
		case <-vm.done:
			if b, _ := vm.Console(); bytes.Contains(b, []byte(marker)) {
				return nil
			}
			ex, _ := vm.Exit()
			return fmt.Errorf("wait for %q on the console of VM %s: VM exited (%s: %s)", marker, vm.spec.Name, ex.Class, ex.Reason)
		case <-tick.C:
		}
	}
}
