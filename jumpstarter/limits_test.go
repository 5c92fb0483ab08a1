package jumpstarter

import (
	"context"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// queued waits until n transfers wait in l's queue.
func queued(l *TransferLimiter, n int) {
	for {
		l.mu.Lock()
		q := len(l.queue)
		l.mu.Unlock()
		if q == n {
			return
		}
		runtime.Gosched()
	}
}

// TestTransferLimiter: ten transfers on a node with three slots: never
// more than three run, the seven others are told they wait (behind
// three running), all run in the end; a waiter whose context ends leaves
// the queue with an error saying what it waited for.
func TestTransferLimiter(t *testing.T) {
	l := NewTransferLimiter(3)
	var running, peak, waited atomic.Int32
	hold := make(chan struct{})
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			queuedHere := false
			rel, err := l.acquire(context.Background(), func(r, _ int) {
				assert.Equal(t, 3, r)
				queuedHere = true
				waited.Add(1)
			})
			assert.NoError(t, err)
			n := running.Add(1)
			for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
			}
			if !queuedHere {
				<-hold // the first three hold their slots
			}
			running.Add(-1)
			rel()
			rel() // idempotent
		}()
	}
	queued(l, 7) // the three others run and wait on hold
	assert.Equal(t, 3, l.Running())

	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		_, err := l.acquire(ctx, nil)
		errc <- err
	}()
	queued(l, 8)
	cancel()
	err := <-errc
	require.ErrorIs(t, err, context.Canceled)
	assert.Contains(t, err.Error(), "waiting for a transfer slot")
	queued(l, 7) // it left the queue

	close(hold)
	wg.Wait()
	assert.Equal(t, int32(3), peak.Load(), "at most three at once")
	assert.Equal(t, int32(7), waited.Load())
	assert.Equal(t, 0, l.Running())
	assert.Empty(t, l.queue)
}
