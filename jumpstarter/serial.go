package jumpstarter

import (
	"context"
	"fmt"
	"sync"
)

// The console child answers upstream's PySerial driver
// (jumpstarter-driver-pyserial, driver.py): the byte stream `connect`
// (what PySerialClient's pexpect(), open(), start-console and pipe open)
// and the calls close, set_dtr(value) and set_rts(value).
//
// A VM's serial port has no modem lines a client can drive: QEMU gives no
// way to set what the guest's UART sees on DSR/CTS, and upstream's own
// QEMU driver, whose console is a pty, fails both calls (a pty has no
// modem control: ENOTTY), so no script written for it relies on them.
// They are accepted and change nothing, so a script written for a board
// (toggling DTR or RTS around a reset) runs on a VM; a value that is not a
// bool (upstream's signature: value: bool) is refused with InvalidArgument.

// consoles are the console streams open on the exporter, so that `close`
// can end them. Any client connection's goroutine adds, removes and
// closes; the mutex guards the set.
type consoles struct {
	mu   sync.Mutex
	open map[*consoleStream]struct{}
}

// consoleStream is one open console stream; cancel ends it (its Stream
// handler then closes the target's console and sends GOAWAY).
type consoleStream struct{ cancel context.CancelFunc }

// add registers a stream until the returned func is called.
func (c *consoles) add(cancel context.CancelFunc) (remove func()) {
	s := &consoleStream{cancel: cancel}
	c.mu.Lock()
	if c.open == nil {
		c.open = map[*consoleStream]struct{}{}
	}
	c.open[s] = struct{}{}
	c.mu.Unlock()
	return func() {
		c.mu.Lock()
		delete(c.open, s)
		c.mu.Unlock()
	}
}

// closeAll ends every open console stream and says how many there were.
func (c *consoles) closeAll() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for s := range c.open {
		s.cancel()
	}
	return len(c.open)
}

// serialCall answers PySerial's exported calls on the console.
func (s *server) serialCall(d *driver, method string, args []any) (any, error) {
	switch method {
	case "close":
		// Upstream: "Force-close any active serial connection ... Safe to
		// call when no stream is active (no-op)." Here: every console
		// stream of this exporter ends (its client reads the end of the
		// stream); the console itself stays, a new `connect` opens it.
		n := s.consoles.closeAll()
		s.e.log.V(1).Info("console streams closed by the client", "streams", n)
		return nil, nil
	case "set_dtr", "set_rts":
		if len(args) != 1 {
			return nil, fmt.Errorf("%w: %s(value) takes one argument, got %d", ErrInvalidArgument, method, len(args))
		}
		if _, ok := args[0].(bool); !ok {
			return nil, fmt.Errorf("%w: %s: value must be a bool, got %s", ErrInvalidArgument, method, describeArg(args[0]))
		}
		return nil, nil // a VM's serial port has no modem lines to drive
	}
	return nil, methodNotFound(d, method)
}
