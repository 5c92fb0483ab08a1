package qemu

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// socketPair is a connected pair of unix stream sockets.
func socketPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	conn := func(fd int, name string) net.Conn {
		f := os.NewFile(uintptr(fd), name)
		c, err := net.FileConn(f)
		require.NoError(t, err)
		f.Close()
		t.Cleanup(func() { c.Close() })
		return c
	}
	return conn(fds[0], "host"), conn(fds[1], "guest")
}

// fakeAgent plays qemu-guest-agent on the guest end of a socket pair: it
// answers guest-sync-delimited as the real agent does (0xFF then the
// reply) and passes every other command to handle, which writes what it
// likes (nothing: no answer).
type fakeAgent struct {
	t *testing.T
	// handle answers a command; true closes the connection.
	handle func(w *bufio.Writer, cmd string, args json.RawMessage) (closeConn bool)
	// syncPrefix is written before each sync answer (stale replies, noise).
	syncPrefix string
	// silent: never answer anything (a guest without an agent).
	silent bool

	mu       sync.Mutex
	commands []string
	dials    atomic.Int32
}

// agent returns a client whose every dial gets a fresh socket pair served
// by f.
func (f *fakeAgent) agent() *guestAgent {
	a := newGuestAgent("vm1", func(ctx context.Context) (net.Conn, error) {
		f.dials.Add(1)
		host, guest := socketPair(f.t)
		go f.serve(guest)
		return host, nil
	})
	a.handshake = 200 * time.Millisecond
	return a
}

func (f *fakeAgent) serve(c net.Conn) {
	r := bufio.NewReader(c)
	w := bufio.NewWriter(c)
	for {
		line, err := r.ReadBytes('\n')
		if err != nil {
			return
		}
		if f.silent {
			continue
		}
		line = bytes.TrimLeft(line, "\xff")
		var cmd struct {
			Execute   string          `json:"execute"`
			Arguments json.RawMessage `json:"arguments"`
		}
		if err := json.Unmarshal(line, &cmd); err != nil {
			fmt.Fprintf(w, `{"error":{"class":"GenericError","desc":"bad json"}}`+"\n")
			w.Flush()
			continue
		}
		f.mu.Lock()
		f.commands = append(f.commands, cmd.Execute)
		f.mu.Unlock()
		if cmd.Execute == "guest-sync-delimited" {
			var a struct{ ID int64 }
			json.Unmarshal(cmd.Arguments, &a)
			w.WriteString(f.syncPrefix)
			fmt.Fprintf(w, "\xff{\"return\": %d}\n", a.ID)
			w.Flush()
			continue
		}
		closeConn := f.handle(w, cmd.Execute, cmd.Arguments)
		w.Flush()
		if closeConn {
			c.Close()
			return
		}
	}
}

func (f *fakeAgent) seen() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.commands...)
}

// shell is a fake guest: guest-exec of "cat" echoes stdin, "sh" with
// "exit N" exits N, "sleep" never exits; status is "not exited" once
// before the real answer.
func shell(w *bufio.Writer, cmd string, raw json.RawMessage) bool {
	switch cmd {
	case "guest-exec":
		var a struct {
			Path    string   `json:"path"`
			Arg     []string `json:"arg"`
			Input   string   `json:"input-data"`
			Capture bool     `json:"capture-output"`
		}
		json.Unmarshal(raw, &a)
		if a.Path == "nope" {
			fmt.Fprint(w, `{"error":{"class":"GenericError","desc":"Failed to execute child process “nope” (No such file or directory)"}}`+"\n")
			return false
		}
		fmt.Fprintf(w, `{"return":{"pid":%d}}`+"\n", register(a.Path, a.Arg, a.Input))
	case "guest-exec-status":
		var a struct{ PID int64 }
		json.Unmarshal(raw, &a)
		fmt.Fprintln(w, status(a.PID))
	default:
		fmt.Fprint(w, `{"error":{"class":"CommandNotFound","desc":"unknown"}}`+"\n")
	}
	return false
}

var (
	procsMu sync.Mutex
	procs   = map[int64]*fakeProc{}
	lastPID int64
)

type fakeProc struct {
	path  string
	args  []string
	input string
	polls int
}

func register(path string, args []string, input string) int64 {
	procsMu.Lock()
	defer procsMu.Unlock()
	lastPID++
	procs[lastPID] = &fakeProc{path: path, args: args, input: input}
	return lastPID
}

func status(pid int64) string {
	procsMu.Lock()
	defer procsMu.Unlock()
	p := procs[pid]
	if p == nil {
		return `{"error":{"class":"GenericError","desc":"Invalid parameter 'pid'"}}`
	}
	p.polls++
	if p.polls == 1 || p.path == "sleep" {
		return `{"return":{"exited":false}}`
	}
	b64 := base64.StdEncoding.EncodeToString
	switch p.path {
	case "cat":
		in, _ := base64.StdEncoding.DecodeString(p.input)
		return fmt.Sprintf(`{"return":{"exited":true,"exitcode":0,"out-data":%q}}`, b64(in))
	case "sh":
		var code int
		fmt.Sscanf(p.args[1], "exit %d", &code)
		return fmt.Sprintf(`{"return":{"exited":true,"exitcode":%d,"err-data":%q}}`, code, b64([]byte("to stderr\n")))
	case "kill":
		return `{"return":{"exited":true,"signal":9}}`
	case "big":
		return fmt.Sprintf(`{"return":{"exited":true,"exitcode":0,"out-data":%q}}`, b64(bytes.Repeat([]byte("x"), MaxExecOutput+10)))
	case "garbage":
		return `{"return":{"exited":true,"exitcode":0,"out-data":"***"}}`
	}
	return `{"return":{"exited":true,"exitcode":0}}`
}

func TestGuestExecStdinStdoutExitCode(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	ctx := context.Background()

	res, err := a.exec(ctx, ExecRequest{Path: "cat", Stdin: []byte("hello\x00\xffbinary")})
	require.NoError(t, err)
	assert.Equal(t, "hello\x00\xffbinary", string(res.Stdout))
	assert.Equal(t, 0, res.ExitCode)

	res, err = a.exec(ctx, ExecRequest{Path: "sh", Args: []string{"-c", "exit 3"}})
	require.NoError(t, err)
	assert.Equal(t, 3, res.ExitCode)
	assert.Equal(t, "to stderr\n", string(res.Stderr))

	res, err = a.exec(ctx, ExecRequest{Path: "kill"})
	require.NoError(t, err)
	assert.Equal(t, 9, res.Signal)
	assert.Equal(t, 137, res.ExitCode)

	// Every command went after a handshake, on one connection.
	assert.Equal(t, int32(1), f.dials.Load())
	seen := f.seen()
	for i := 0; i < len(seen); i += 2 {
		assert.Equal(t, "guest-sync-delimited", seen[i], "command %d of %v", i, seen)
	}
}

// The argv reaches guest-exec as path + arg, untouched by any shell.
func TestGuestExecArgvUnquoted(t *testing.T) {
	var got struct {
		Path string   `json:"path"`
		Arg  []string `json:"arg"`
	}
	f := &fakeAgent{t: t, handle: func(w *bufio.Writer, cmd string, raw json.RawMessage) bool {
		if cmd == "guest-exec" {
			json.Unmarshal(raw, &got)
		}
		return shell(w, cmd, raw)
	}}
	a := f.agent()
	defer a.close()
	args := []string{"$(reboot)", "a b; rm -rf /", `"'`}
	_, err := a.exec(context.Background(), ExecRequest{Path: "echo", Args: args})
	require.NoError(t, err)
	assert.Equal(t, "echo", got.Path)
	assert.Equal(t, args, got.Arg)
}

// Replies left on the channel by abandoned commands and noise are skipped.
func TestGuestAgentSkipsStaleReplies(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell,
		syncPrefix: "junk\n\xff{\"return\": 12345}\n{\"return\":{\"pid\":99}}\n\xffnot json\n"}
	a := f.agent()
	defer a.close()
	res, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: []byte("x")})
	require.NoError(t, err)
	assert.Equal(t, "x", string(res.Stdout))
}

func TestGuestAgentNotResponding(t *testing.T) {
	f := &fakeAgent{t: t, silent: true}
	a := f.agent()
	defer a.close()
	start := time.Now()
	_, err := a.exec(context.Background(), ExecRequest{Path: "uname"})
	require.ErrorIs(t, err, ErrGuestAgentNotResponding)
	assert.Contains(t, err.Error(), "guest agent not responding on VM vm1")
	assert.Contains(t, err.Error(), "the image runs no qemu-guest-agent")
	assert.Less(t, time.Since(start), 10*time.Second)
	// The connection was dropped and dialled again at once (the port's
	// host end stays open: holdGuestAgent); the next try uses that one.
	assert.Equal(t, int32(2), f.dials.Load())
	_, err = a.exec(context.Background(), ExecRequest{Path: "uname"})
	require.ErrorIs(t, err, ErrGuestAgentNotResponding)
	assert.Equal(t, int32(3), f.dials.Load())
}

// hold opens the channel without sending anything, keeps it for the next
// command, and is a no-op while a connection is there.
func TestGuestAgentHold(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	require.NoError(t, a.hold(context.Background()))
	require.NoError(t, a.hold(context.Background()))
	assert.Equal(t, int32(1), f.dials.Load())
	f.mu.Lock()
	assert.Empty(t, f.commands, "hold sends nothing")
	f.mu.Unlock()
	res, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: []byte("held")})
	require.NoError(t, err)
	assert.Equal(t, "held", string(res.Stdout))
	assert.Equal(t, int32(1), f.dials.Load(), "the held connection serves the command")
	a.close()
	require.ErrorIs(t, a.hold(context.Background()), errVMExited)
}

func TestGuestAgentHoldNoChannel(t *testing.T) {
	a := newGuestAgent("vm1", func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", filepath.Join(t.TempDir(), "none.sock"))
	})
	require.ErrorIs(t, a.hold(context.Background()), ErrNoGuestAgentChannel)
}

func TestGuestAgentMalformedReplies(t *testing.T) {
	for name, reply := range map[string]string{
		"not json":       "{{{\n",
		"no return":      `{"hello":1}` + "\n",
		"closed at once": "",
		"pid not int":    `{"return":{"pid":"x"}}` + "\n",
		"no pid":         `{"return":{}}` + "\n",
	} {
		t.Run(name, func(t *testing.T) {
			f := &fakeAgent{t: t}
			var execs atomic.Int32
			f.handle = func(w *bufio.Writer, cmd string, raw json.RawMessage) bool {
				if cmd != "guest-exec" || execs.Add(1) > 1 { // the second exec gets a good answer
					return shell(w, cmd, raw)
				}
				if reply == "" {
					return true
				}
				w.WriteString(reply)
				return false
			}
			a := f.agent()
			defer a.close()
			_, err := a.exec(context.Background(), ExecRequest{Path: "cat"})
			require.Error(t, err)
			assert.Contains(t, err.Error(), "VM vm1")
			// Not stuck: the next exec works (on a new connection after a
			// broken reply).
			res, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: []byte("ok")})
			require.NoError(t, err)
			assert.Equal(t, "ok", string(res.Stdout))
			wantDials := int32(2)
			if name == "no pid" { // well-formed: the connection is kept
				wantDials = 1
			}
			assert.Equal(t, wantDials, f.dials.Load())
		})
	}
}

func TestGuestAgentErrorKeepsConnection(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	_, err := a.exec(context.Background(), ExecRequest{Path: "nope"})
	var ge *GuestAgentError
	require.ErrorAs(t, err, &ge)
	assert.Equal(t, "GenericError", ge.Class)
	assert.Contains(t, err.Error(), "No such file or directory")
	_, err = a.exec(context.Background(), ExecRequest{Path: "true"})
	require.NoError(t, err)
	assert.Equal(t, int32(1), f.dials.Load())
}

func TestGuestExecOutputLimit(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	_, err := a.exec(context.Background(), ExecRequest{Path: "big"})
	require.ErrorIs(t, err, ErrExecOutputTooLarge)
	_, err = a.exec(context.Background(), ExecRequest{Path: "garbage"})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not base64")
	// Still usable afterwards.
	res, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: []byte("after")})
	require.NoError(t, err)
	assert.Equal(t, "after", string(res.Stdout))
}

func TestGuestExecBadRequests(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	_, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: make([]byte, MaxExecStdin+1)})
	require.ErrorIs(t, err, ErrExecStdinTooLarge)
	_, err = a.exec(context.Background(), ExecRequest{})
	require.Error(t, err)
	_, err = a.exec(context.Background(), ExecRequest{Path: "echo", Args: []string{"a\x00b"}})
	require.Error(t, err)
	assert.Equal(t, int32(0), f.dials.Load(), "refused before reaching the guest")
}

func TestGuestExecTimeout(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := a.exec(ctx, ExecRequest{Path: "sleep", Args: []string{"100"}})
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "keeps running in the guest")

	// A reply that never comes: the context ends the read.
	f2 := &fakeAgent{t: t, handle: func(w *bufio.Writer, cmd string, raw json.RawMessage) bool { return false }}
	a2 := f2.agent()
	defer a2.close()
	ctx2, cancel2 := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel2)
	_, err = a2.exec(ctx2, ExecRequest{Path: "cat"})
	require.ErrorIs(t, err, context.Canceled)
}

func TestGuestExecConcurrent(t *testing.T) {
	f := &fakeAgent{t: t, handle: shell}
	a := f.agent()
	defer a.close()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			in := fmt.Sprintf("input %d", i)
			res, err := a.exec(context.Background(), ExecRequest{Path: "cat", Stdin: []byte(in)})
			if err == nil && string(res.Stdout) != in {
				err = fmt.Errorf("got %q for %q", res.Stdout, in)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		assert.NoError(t, err)
	}
}

func TestGuestAgentNoChannel(t *testing.T) {
	a := newGuestAgent("vm1", func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", filepath.Join(t.TempDir(), GuestAgentSocketName))
	})
	_, err := a.exec(context.Background(), ExecRequest{Path: "true"})
	require.ErrorIs(t, err, ErrNoGuestAgentChannel)
	a.close()
	_, err = a.exec(context.Background(), ExecRequest{Path: "true"})
	require.Error(t, err)
	assert.True(t, errors.Is(err, errVMExited), "%v", err)
}
