package jumpstarter

import (
	"context"
	"fmt"
	"sync"
)

// TransferLimiter bounds the flashes (from files, presigned URLs and OCI
// images) and dumps that run at once on a node: each takes a slot for its
// whole run, and one that finds none free waits its turn, first come first
// served, saying so in the lease's LogStream. The node makes one and
// shares it among all its exporters (ResourceOptions.Transfers). Safe for
// concurrent use; its mutex guards the queue only.
type TransferLimiter struct {
	max int

	mu      sync.Mutex
	running int
	queue   []chan struct{} // waiters in order; closed when given a slot
}

// NewTransferLimiter lets n transfers run at once (n < 1: 1).
func NewTransferLimiter(n int) *TransferLimiter {
	return &TransferLimiter{max: max(1, n)}
}

// Max is how many transfers may run at once.
func (l *TransferLimiter) Max() int { return l.max }

// Running is how many transfers run now.
func (l *TransferLimiter) Running() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.running
}

// acquire takes a slot, waiting for one while ctx lasts; waiting is
// called (once, before the wait) when there is none free. A nil limiter
// has a slot for everyone.
func (l *TransferLimiter) acquire(ctx context.Context, waiting func(running, queued int)) (release func(), err error) {
	if l == nil {
		return func() {}, nil
	}
	l.mu.Lock()
	if l.running < l.max && len(l.queue) == 0 {
		l.running++
		l.mu.Unlock()
		return l.releaseOnce(), nil
	}
	ch := make(chan struct{})
	l.queue = append(l.queue, ch)
	running, queued := l.running, len(l.queue)
	l.mu.Unlock()
	if waiting != nil {
		waiting(running, queued)
	}
	select {
	case <-ch:
		return l.releaseOnce(), nil
	case <-ctx.Done():
		l.mu.Lock()
		for i, c := range l.queue {
			if c == ch {
				l.queue = append(l.queue[:i], l.queue[i+1:]...)
				l.mu.Unlock()
				return nil, fmt.Errorf("waiting for a transfer slot: %w", ctx.Err())
			}
		}
		l.mu.Unlock()
		// Given a slot as ctx ended: hand it on.
		l.release()
		return nil, fmt.Errorf("waiting for a transfer slot: %w", ctx.Err())
	}
}

func (l *TransferLimiter) releaseOnce() func() {
	var once sync.Once
	return func() { once.Do(l.release) }
}

// release frees a slot, or hands it to the first waiter.
func (l *TransferLimiter) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.queue) > 0 {
		close(l.queue[0])
		l.queue = l.queue[1:]
		return
	}
	l.running--
}

// transferSlot takes a slot of the node's transfer limiter for op,
// telling the lease in its LogStream (and through progress, when set)
// while it waits.
func (e *Exporter) transferSlot(ctx context.Context, op string, progress func(string)) (func(), error) {
	l := e.cfg.Resources.Transfers
	return l.acquire(ctx, func(running, queued int) {
		msg := fmt.Sprintf("waiting for a transfer slot: %d flashes and dumps run on this node (at most %d at once), %d waiting with this one", running, l.max, queued)
		e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: op, Message: msg})
		e.log.Info("transfer queued", "operation", op, "running", running, "queued", queued)
		if progress != nil {
			progress(msg)
		}
	})
}

// transfer runs f (a flash of an OCI image) in a transfer slot, within
// the transfer timeout: flash_oci's and a flash hook step's.
func (e *Exporter) transfer(ctx context.Context, op string, progress func(string), f func(context.Context, func(string)) error) error {
	release, err := e.transferSlot(ctx, op, progress)
	if err != nil {
		return err
	}
	defer release()
	ctx, cancel := context.WithTimeout(ctx, e.cfg.Resources.withDefaults().TransferTimeout)
	defer cancel()
	return f(ctx, progress)
}
