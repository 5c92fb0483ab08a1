package pinned

import (
	"os/exec"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// onRetiredThread runs f on a thread that ends when f returns, the way
// qemu's confined start does: a goroutine that exits while locked to its
// thread (not the main thread, which Go wedges instead of ending).
func onRetiredThread(f func()) {
	done := make(chan struct{})
	var run func()
	run = func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			inner := make(chan struct{})
			go func() { defer close(inner); run() }()
			<-inner
			runtime.UnlockOSThread()
			return
		}
		defer close(done)
		f()
	}
	go run()
	<-done
}

func retireThreads(n int) {
	for i := 0; i < n; i++ {
		onRetiredThread(func() {})
	}
}

func sleeper() *exec.Cmd {
	cmd := exec.Command("sleep", "60")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	return cmd
}

// TestPinnedChildOutlivesRetiredThreads: a child forked plainly on a thread
// that then ends is killed by its Pdeathsig (the kernel's rule this package
// exists for); one started by Start survives any number of retired
// threads and still dies with a Kill and is reaped by Wait.
func TestPinnedChildOutlivesRetiredThreads(t *testing.T) {
	plain := sleeper()
	var err error
	onRetiredThread(func() { err = plain.Start() })
	require.NoError(t, err)
	err = plain.Wait()
	require.Error(t, err, "a child whose forking thread ended gets its Pdeathsig")
	ws, ok := plain.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok)
	assert.Equal(t, syscall.SIGKILL, ws.Signal())

	pinned := sleeper()
	onRetiredThread(func() { err = Start(pinned) }) // the caller's thread ends too
	require.NoError(t, err)
	exited := make(chan error, 1)
	go func() { exited <- pinned.Wait() }()
	retireThreads(50)
	select {
	case err := <-exited:
		t.Fatalf("the pinned child died with a retired thread: %v", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, pinned.Process.Kill())
	err = <-exited
	ws, ok = pinned.ProcessState.Sys().(syscall.WaitStatus)
	require.True(t, ok, "%v", err)
	assert.Equal(t, syscall.SIGKILL, ws.Signal(), "killed by us, reaped by Wait")
}

func TestStartReportsStartErrors(t *testing.T) {
	err := Start(exec.Command("/nonexistent/qk-binary"))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "/nonexistent/qk-binary")
	require.NoError(t, Run(exec.Command("true")))
	assert.Error(t, Run(exec.Command("false")))
}
