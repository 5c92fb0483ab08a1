package jstest

import (
	"context"
	"errors"
	"fmt"
	"io"
	"regexp"
	"sync"
	"time"
)

// Client classes: what upstream's Python client classes do with a driver's
// calls (jumpstarter-dev/jumpstarter b1f2bb41), in Go, so tests make the
// same calls in the same order with the same framing.

// Serial is jumpstarter_driver_pyserial.client.PySerialClient over a
// session: every method opens the driver's `connect` byte stream.
type Serial struct {
	s    *Session
	uuid string
}

// Serial is the PySerialClient of the driver uuid.
func (s *Session) Serial(uuid string) *Serial { return &Serial{s: s, uuid: uuid} }

// Call is a driver call on the console (close, set_dtr, set_rts: the
// driver's exports, which the class reaches as client.call(...)).
func (c *Serial) Call(ctx context.Context, method string, args ...any) (any, error) {
	return c.s.Call(ctx, c.uuid, method, args...)
}

// Pexpect is PySerialClient.pexpect() (and open()): PexpectAdapter streams
// `connect` through a local TCP port forward and hands the socket to
// pexpect's fdspawn. The forward sends what the socket reads, so a
// sendline is one frame, as here.
func (c *Serial) Pexpect(ctx context.Context) (*Expecter, error) {
	rw, err := c.s.Stream(ctx, c.uuid, "connect")
	if err != nil {
		return nil, err
	}
	x := &Expecter{rw: rw, chunks: make(chan []byte, 16), done: make(chan struct{}), closed: make(chan struct{})}
	go x.read()
	return x, nil
}

// Expecter is the part of pexpect's spawn a test script uses: send,
// sendline, expect.
type Expecter struct {
	rw     io.ReadWriteCloser
	chunks chan []byte
	done   chan struct{} // closed when the stream's read side ended
	err    error         // why it ended (io.EOF: the stream's end); set before done
	closed chan struct{} // Close was called
	once   sync.Once

	buf []byte // read but not matched yet (expect's caller only)
}

func (x *Expecter) read() {
	defer close(x.done)
	for {
		b := make([]byte, 4096)
		n, err := x.rw.Read(b)
		if n > 0 {
			select {
			case x.chunks <- b[:n]:
			case <-x.closed:
				return
			}
		}
		if err != nil {
			x.err = err
			return
		}
	}
}

// Send writes s to the console (pexpect's send).
func (x *Expecter) Send(s string) error {
	_, err := x.rw.Write([]byte(s))
	return err
}

// SendLine is pexpect's sendline: s and os.linesep ("\n").
func (x *Expecter) SendLine(s string) error { return x.Send(s + "\n") }

// Expect is pexpect's expect(pattern): it reads until pattern matches what
// came since the last match and returns the text before the match and
// the match's groups; the rest stays for the next Expect. It fails when ctx
// ends (pexpect's TIMEOUT) or the stream ends first (pexpect's EOF), with
// what was read so far in the error.
func (x *Expecter) Expect(ctx context.Context, pattern *regexp.Regexp) (before string, groups []string, err error) {
	for {
		if loc := pattern.FindSubmatchIndex(x.buf); loc != nil {
			before = string(x.buf[:loc[0]])
			for i := 0; i < len(loc); i += 2 {
				g := ""
				if loc[i] >= 0 {
					g = string(x.buf[loc[i]:loc[i+1]])
				}
				groups = append(groups, g)
			}
			x.buf = append([]byte(nil), x.buf[loc[1]:]...)
			return before, groups, nil
		}
		select {
		case b := <-x.chunks:
			x.buf = append(x.buf, b...)
		case <-x.done:
			select {
			case b := <-x.chunks: // what came before the end
				x.buf = append(x.buf, b...)
				continue
			default:
			}
			return "", nil, fmt.Errorf("expect %q: the stream ended (%v) after %q", pattern, x.err, x.buf)
		case <-ctx.Done():
			return "", nil, fmt.Errorf("expect %q: %w after %q", pattern, ctx.Err(), x.buf)
		}
	}
}

// Close ends the session at once (the stream is canceled if the exporter
// has not ended it shortly after the GOAWAY).
func (x *Expecter) Close() error {
	x.once.Do(func() { close(x.closed) })
	return x.rw.Close()
}

// Finish is what pexpect's close does through PexpectAdapter's port
// forward: the socket's end becomes the stream's end of input (send_eof:
// GOAWAY, half-close) and the forward then waits for the exporter to end
// the stream; nothing cancels it. Finish fails if ctx ends first.
func (x *Expecter) Finish(ctx context.Context) error {
	cw, ok := x.rw.(interface{ CloseWrite() error })
	if !ok {
		return errors.New("finish: the stream cannot half-close")
	}
	if err := cw.CloseWrite(); err != nil {
		return err
	}
	for {
		select {
		case <-x.chunks: // output still coming: the forward drops it
		case <-x.done:
			return x.Close()
		case <-ctx.Done():
			_ = x.Close()
			return fmt.Errorf("finish: the exporter did not end the stream after its end of input: %w", ctx.Err())
		}
	}
}

// ctrlB is start-console's escape: three in a row end the session.
const ctrlB = 0x02

// StartConsole is `j console start-console` (pyserial console.py): stdin
// goes to the stream one byte per send, the stream's bytes to stdout. A
// Ctrl-B is sent like any byte, except that the third in a row ends the
// session without being sent. It returns nil then, and the stream's end or
// ctx's error otherwise. At stdin's end it keeps showing output (upstream
// polls stdin again).
func (c *Serial) StartConsole(ctx context.Context, stdin io.Reader, stdout io.Writer) error {
	rw, err := c.s.Stream(ctx, c.uuid, "connect")
	if err != nil {
		return err
	}
	defer rw.Close()
	out := make(chan error, 1)
	go func() {
		_, err := io.Copy(stdout, rw)
		if err == nil {
			err = io.EOF
		}
		out <- err
	}()
	exit := make(chan error, 1)
	go func() {
		b := make([]byte, 1)
		count := 0
		for {
			if _, err := stdin.Read(b); err != nil {
				return // stdin ended: output goes on
			}
			if b[0] == ctrlB {
				if count++; count == 3 {
					exit <- nil
					return
				}
			} else {
				count = 0
			}
			if _, err := rw.Write(b); err != nil {
				exit <- err
				return
			}
		}
	}()
	select {
	case err := <-exit:
		return err
	case err := <-out:
		return fmt.Errorf("start-console: %w", err)
	case <-ctx.Done():
		return ctx.Err()
	}
}

// PipeOptions are `j console pipe`'s: Input is stdin when it is enabled
// (piped, or -i), nil otherwise; Output is where the console goes (stdout
// or -o FILE); NoOutput is --no-output (send stdin and exit at its end).
type PipeOptions struct {
	Input    io.Reader
	Output   io.Writer
	NoOutput bool
}

// Pipe is `j console pipe` (PySerialClient._pipe_serial): stdin goes up in
// reads of at most 1024 bytes, then the stream is half-closed (send_eof:
// GOAWAY); the console's output is written to Output until the stream ends
// (nil: "Serial connection closed normally") or ctx ends (Ctrl+C: its
// error). With NoOutput it returns once stdin is sent.
func (c *Serial) Pipe(ctx context.Context, o PipeOptions) error {
	rw, err := c.s.Stream(ctx, c.uuid, "connect")
	if err != nil {
		return err
	}
	defer rw.Close()
	send := func() error {
		buf := make([]byte, 1024)
		for {
			n, err := o.Input.Read(buf)
			if n > 0 {
				if _, werr := rw.Write(buf[:n]); werr != nil {
					return werr
				}
			}
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				return err
			}
		}
		if cw, ok := rw.(interface{ CloseWrite() error }); ok {
			// send_eof suppresses the stream's errors: a stream the
			// exporter ended says why on the read side.
			_ = cw.CloseWrite()
		}
		return nil
	}
	if o.NoOutput {
		if o.Input == nil {
			return errors.New("pipe: --no-output requires stdin input")
		}
		if err := send(); err != nil {
			return err
		}
		// The exporter ends a console's stream at the end of input, once
		// what came before it went to the guest; closing the stream at
		// once cancels it, and a cancel can overtake the last data
		// (seen under -race). Wait for that end, discarding the output.
		_, err := io.Copy(io.Discard, rw)
		return err
	}
	sent := make(chan error, 1)
	if o.Input != nil {
		go func() { sent <- send() }()
	}
	out := make(chan error, 1)
	go func() { _, err := io.Copy(o.Output, rw); out <- err }()
	select {
	case err = <-out:
	case <-ctx.Done():
		err = ctx.Err()
	}
	select {
	case serr := <-sent: // stdin's forwarding failed before the end
		if err == nil {
			err = serr
		}
	default: // still reading stdin: upstream cancels it
	}
	return err
}

// Power is jumpstarter_driver_power.client.PowerClient over a session.
type Power struct {
	s    *Session
	uuid string
}

// Power is the PowerClient of the driver uuid.
func (s *Session) Power(uuid string) *Power { return &Power{s: s, uuid: uuid} }

// On and Off are `j power on` / `j power off`.
func (p *Power) On(ctx context.Context) error {
	_, err := p.s.Call(ctx, p.uuid, "on")
	return err
}

func (p *Power) Off(ctx context.Context) error {
	_, err := p.s.Call(ctx, p.uuid, "off")
	return err
}

// Cycle is `j power cycle --wait W` (PowerClient.cycle): off, a sleep of
// wait, on.
func (p *Power) Cycle(ctx context.Context, wait time.Duration) error {
	if err := p.Off(ctx); err != nil {
		return err
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	return p.On(ctx)
}
