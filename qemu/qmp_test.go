package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/stretchr/testify/require"
)

// hungQMP is a fake QMP server on a unix socket: it sends the greeting and
// answers qmp_capabilities, then reads every further command and never
// answers (a hung QEMU), except the commands given a reply in answers.
// No QEMU runs.
type hungQMP struct {
	mu       sync.Mutex
	commands []string
	conns    []net.Conn
	answers  map[string]string // command -> reply line
}

// answer makes the server reply to command with reply from now on.
func (h *hungQMP) answer(command, reply string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.answers == nil {
		h.answers = map[string]string{}
	}
	h.answers[command] = reply
}

func startHungQMP(t *testing.T, sock string) *hungQMP {
	t.Helper()
	l, err := net.Listen("unix", sock)
	require.NoError(t, err)
	h := &hungQMP{}
	t.Cleanup(func() {
		l.Close()
		h.mu.Lock()
		for _, c := range h.conns {
			c.Close()
		}
		h.mu.Unlock()
	})
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			h.mu.Lock()
			h.conns = append(h.conns, c)
			h.mu.Unlock()
			go h.serve(c)
		}
	}()
	return h
}

func (h *hungQMP) serve(c net.Conn) {
	defer c.Close()
	if _, err := c.Write([]byte(`{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 8}, "package": ""}, "capabilities": []}}` + "\n")); err != nil {
		return
	}
	sc := bufio.NewScanner(c)
	dec := func() (string, bool) {
		if !sc.Scan() {
			return "", false
		}
		var cmd struct {
			Execute string `json:"execute"`
		}
		_ = json.Unmarshal(sc.Bytes(), &cmd)
		return cmd.Execute, true
	}
	// go-qemu writes commands without a newline: split on '}' ends.
	sc.Split(splitJSON)
	if cmd, ok := dec(); !ok || cmd != "qmp_capabilities" {
		return
	}
	if _, err := c.Write([]byte(`{"return": {}}` + "\n")); err != nil {
		return
	}
	for {
		cmd, ok := dec()
		if !ok {
			return
		}
		h.mu.Lock()
		h.commands = append(h.commands, cmd)
		reply, ok := h.answers[cmd]
		h.mu.Unlock()
		if ok {
			if _, err := c.Write([]byte(reply + "\n")); err != nil {
				return
			}
		}
	}
}

// splitJSON splits a stream of JSON objects (not newline-separated).
func splitJSON(data []byte, atEOF bool) (int, []byte, error) {
	depth, inStr, esc := 0, false, false
	for i, b := range data {
		switch {
		case esc:
			esc = false
		case inStr && b == '\\':
			esc = true
		case b == '"':
			inStr = !inStr
		case inStr:
		case b == '{':
			depth++
		case b == '}':
			depth--
			if depth == 0 {
				return i + 1, data[:i+1], nil
			}
		}
	}
	if atEOF && len(data) > 0 {
		return len(data), nil, nil
	}
	return 0, nil, nil
}

func (h *hungQMP) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]string(nil), h.commands...)
}

// connectToFake returns a VM supervised through the fake QMP server at its
// state dir (pid 0: nothing to signal).
func connectToFake(t *testing.T) (*VM, *hungQMP) {
	t.Helper()
	dir, err := os.MkdirTemp("/tmp", "qk-qmp-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	spec := Spec{Name: "fake", StateDir: dir}
	h := startHungQMP(t, filepath.Join(dir, QMPSocketName))
	vm := newVM(spec, dir, 0, logr.Discard())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, vm.connect(ctx))
	go vm.supervise()
	t.Cleanup(vm.Detach)
	return vm, h
}

// settleGoroutines waits until the goroutine count is at most want.
func settleGoroutines(want int, d time.Duration) int {
	deadline := time.Now().Add(d)
	for {
		n := runtime.NumGoroutine()
		if n <= want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestHungQMPBoundsGoroutines: every QMP call against a QEMU that never
// answers returns when its context ends, and however many calls time out
// at most one goroutine per VM stays waiting on QMP; Detach ends it.
func TestHungQMPBoundsGoroutines(t *testing.T) {
	vm, h := connectToFake(t)
	base := settleGoroutines(0, 200*time.Millisecond)
	const calls = 20
	for i := range calls {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		t0 := time.Now()
		_, err := vm.RunState(ctx)
		cancel()
		require.Error(t, err, "call %d", i)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(t0), 2*time.Second, "call %d returned late", i)
	}
	n := settleGoroutines(base+1, 2*time.Second)
	require.LessOrEqual(t, n, base+1, "goroutines after %d timed-out QMP calls: %d (was %d)", calls, n, base)
	require.Equal(t, []string{"query-status"}, h.seen(), "one command went out; the others waited for the slot")

	vm.Detach()
	n = settleGoroutines(base-1, 2*time.Second) // the supervisor's goroutines end too
	require.Less(t, n, base, "goroutines after Detach: %d (was %d)", n, base)
	_, err := vm.RunState(context.Background())
	require.ErrorIs(t, err, errVMDetached, "a detached VM's QMP fails at once")
}

// TestQuitHasATimeout: the supervisor's quit (after a guest shutdown or
// panic) returns within quitTimeout when QEMU never answers.
func TestQuitHasATimeout(t *testing.T) {
	vm, h := connectToFake(t)
	old := quitTimeout
	quitTimeout = 100 * time.Millisecond
	t.Cleanup(func() { quitTimeout = old })
	done := make(chan struct{})
	go func() { vm.quit(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("quit did not return 5 s after its 100 ms timeout against a hung QMP")
	}
	require.Contains(t, h.seen(), "quit")
	vm.mu.Lock()
	forcing := vm.forcing
	vm.mu.Unlock()
	require.True(t, strings.Contains(forcing, "SIGKILL"), "an unanswered quit kills QEMU: %q", forcing)
}

// TestQuitErrorKillsAStillRunningQEMU: a quit that fails with an error
// other than a timeout (here QEMU answers it with an error and stays) does
// not leave QEMU paused for ever: it is killed quitTimeout later, so the
// exit gets recorded. A VM detached meanwhile is left running.
func TestQuitErrorKillsAStillRunningQEMU(t *testing.T) {
	const refused = `{"error": {"class": "GenericError", "desc": "quit refused"}}`
	old := quitTimeout
	quitTimeout = 100 * time.Millisecond
	t.Cleanup(func() { quitTimeout = old })
	forcing := func(vm *VM) string {
		vm.mu.Lock()
		defer vm.mu.Unlock()
		return vm.forcing
	}
	quitWithin := func(t *testing.T, vm *VM, d time.Duration) {
		t.Helper()
		done := make(chan struct{})
		go func() { vm.quit(); close(done) }()
		select {
		case <-done:
		case <-time.After(d):
			t.Fatalf("quit did not return %s after its %s timeout against a QEMU that refused it", d, quitTimeout)
		}
	}

	t.Run("Killed", func(t *testing.T) {
		vm, h := connectToFake(t)
		h.answer("quit", refused)
		quitWithin(t, vm, 5*time.Second)
		require.Contains(t, h.seen(), "quit")
		require.Contains(t, forcing(vm), "SIGKILL", "a QEMU still there after a failed quit is killed")
	})
	t.Run("DetachedIsLeftRunning", func(t *testing.T) {
		vm, h := connectToFake(t)
		h.answer("quit", refused)
		quitTimeout = 2 * time.Second // room to detach while quit waits
		t.Cleanup(func() { quitTimeout = 100 * time.Millisecond })
		done := make(chan struct{})
		go func() { vm.quit(); close(done) }()
		require.Eventually(t, func() bool { return slices.Contains(h.seen(), "quit") }, 5*time.Second, 10*time.Millisecond, "the quit command reaches QEMU")
		vm.Detach()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("quit did not return within 10 s of Detach")
		}
		require.Empty(t, forcing(vm), "a detached VM is not killed")
	})
}

// TestEventsClosedOnDetach: Detach ends every event subscription (the
// channel closes, its goroutine ends); subscribing afterwards yields a
// closed channel.
func TestEventsClosedOnDetach(t *testing.T) {
	vm, _ := connectToFake(t)
	base := settleGoroutines(0, 200*time.Millisecond)
	subs := make([]<-chan Event, 5)
	for i := range subs {
		subs[i] = vm.Events(context.Background())
	}
	vm.Detach()
	for i, ch := range subs {
		select {
		case _, ok := <-ch:
			require.False(t, ok, "subscription %d got an event instead of closing", i)
		case <-time.After(2 * time.Second):
			t.Fatalf("subscription %d still open after Detach", i)
		}
	}
	n := settleGoroutines(base-1, 2*time.Second)
	require.Less(t, n, base, "goroutines after Detach: %d (was %d with 5 subscriptions)", n, base)
	select {
	case _, ok := <-vm.Events(context.Background()):
		require.False(t, ok)
	case <-time.After(time.Second):
		t.Fatal("Events after Detach must return a closed channel")
	}
}

// TestExitRecordedWhenQMPNeverCloses: a QEMU this process started is
// reaped, but go-qemu's reader is stuck (here: blocked handing on a reply
// no command waits for, so it never reports the connection's end). The
// exit is still recorded, from the reaped process, with its status.
func TestExitRecordedWhenQMPNeverCloses(t *testing.T) {
	dir, err := os.MkdirTemp("/tmp", "qk-qmp-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	l, err := net.Listen("unix", filepath.Join(dir, QMPSocketName))
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		t.Cleanup(func() { c.Close() })
		_, _ = c.Write([]byte(`{"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 8}, "package": ""}, "capabilities": []}}` + "\n"))
		sc := bufio.NewScanner(c)
		sc.Split(splitJSON)
		if !sc.Scan() { // qmp_capabilities
			return
		}
		// Its reply, then one no command asked for: go-qemu's reader blocks
		// on it. The connection stays open.
		_, _ = c.Write([]byte(`{"return": {}}` + "\n" + `{"return": {}}` + "\n"))
		for sc.Scan() {
		}
	}()
	old := exitUnreportedGrace
	exitUnreportedGrace = 200 * time.Millisecond
	t.Cleanup(func() { exitUnreportedGrace = old })

	vm := newVM(Spec{Name: "fake", StateDir: dir}, dir, 0, logr.Discard())
	vm.childDone = make(chan struct{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, vm.connect(ctx))
	go vm.supervise()
	t.Cleanup(vm.Detach)

	vm.mu.Lock()
	vm.childStatus = "signal: killed"
	vm.mu.Unlock()
	close(vm.childDone) // the child was reaped
	select {
	case <-vm.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the reaped QEMU's exit was not recorded within 10 s (supervise waited on QMP alone)")
	}
	ex, ok := vm.Exit()
	require.True(t, ok)
	require.Equal(t, ExitCrashed, ex.Class)
	require.Equal(t, "QEMU exited unexpectedly (signal: killed)", ex.Reason, "the exit carries the reaped process's status")
}
