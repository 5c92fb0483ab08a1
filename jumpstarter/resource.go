package jumpstarter

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/internal/streamconn"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Resources: how a client hands a driver call a file (upstream's
// jumpstarter/common/resources.py and Driver.resource, b1f2bb41).
//
//   - client_stream: the client opens RouterService.Stream with `request`
//     {"kind":"resource","uuid":<driver>,"x_jmp_content_encoding":<enc|null>};
//     the exporter answers in the initial metadata with `resource`, a JSON
//     handle {"kind":"client_stream","uuid":<new>,"x_jmp_content_encoding":...}
//     and, when it decodes that encoding itself, `x_jmp_accept_encoding`
//     (otherwise the client decodes before sending). The client then sends
//     the bytes (GOAWAY ends them) while it passes the handle as a call's
//     argument (flash, dump); dump writes the other way on the same stream.
//   - presigned_request: {"kind":"presigned_request","url","method",
//     "headers"}: the exporter itself GETs (flash) or PUTs (dump) the URL.
//
// The stream handler (Stream's goroutine) owns registering and removing a
// client_stream; the one call that claims it owns reading or writing it,
// and releases it when done, which ends the stream. resources' mutex guards
// the table only.

// Content encodings of upstream's Compression (jumpstarter/streams/encoding.py).
const (
	EncodingGzip = "gzip"
	EncodingXZ   = "xz"
	EncodingBZ2  = "bz2"
	EncodingZstd = "zstd"
)

// acceptedEncodings are the encodings a client_stream is accepted in: the
// exporter decodes them on flash and encodes them on dump. bz2 is left to
// the client (Go has no bzip2 encoder); the client then sends plain bytes,
// as upstream's client does for any encoding the exporter does not accept.
var acceptedEncodings = map[string]bool{EncodingGzip: true, EncodingXZ: true, EncodingZstd: true}

// ResourceOptions bound resource transfers (zero values: the defaults).
type ResourceOptions struct {
	// WaitTimeout is how long a call waits for a client_stream handle's
	// stream to be open on this exporter (default 10 s).
	WaitTimeout time.Duration
	// StallTimeout fails a transfer when the peer sends (or, for dump,
	// accepts) nothing for this long (default 60 s).
	StallTimeout time.Duration
	// TransferTimeout bounds a whole transfer, client_stream or
	// presigned_request, flash or dump, besides the stall timeout
	// (default 2 h, upstream's resource timeout).
	TransferTimeout time.Duration
	// Fetch says where presigned requests and flash_oci registries may
	// be reached (fetchpolicy.go).
	Fetch FetchPolicy
	// Transfers bounds the flashes and dumps running at once; the node
	// shares one among all its exporters (nil: no bound).
	Transfers *TransferLimiter
	// AllowLocalFetch lifts the fetch policy altogether: presigned
	// requests and flash_oci registries may be anywhere, over plain HTTP
	// too. Tests only.
	AllowLocalFetch bool
}

func (o ResourceOptions) withDefaults() ResourceOptions {
	if o.WaitTimeout <= 0 {
		o.WaitTimeout = 10 * time.Second
	}
	if o.StallTimeout <= 0 {
		o.StallTimeout = 60 * time.Second
	}
	if o.TransferTimeout <= 0 {
		o.TransferTimeout = 2 * time.Hour
	}
	return o
}

// clientStream is one open client_stream resource.
type clientStream struct {
	id, driver string
	enc        string // accepted content encoding, "" for plain bytes
	conn       *streamconn.Conn

	claimed bool          // resources.mu
	release chan struct{} // closed by the claimer when done (releaseOnce)
	once    sync.Once
}

func (c *clientStream) done() { c.once.Do(func() { close(c.release) }) }

// resources is the exporter's table of open client_streams by uuid.
type resources struct {
	mu      sync.Mutex
	m       map[string]*clientStream
	changed chan struct{} // closed and replaced on every add
}

func newResources() *resources {
	return &resources{m: map[string]*clientStream{}, changed: make(chan struct{})}
}

func (rs *resources) add(c *clientStream) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.m[c.id] = c
	close(rs.changed)
	rs.changed = make(chan struct{})
}

func (rs *resources) remove(id string) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	delete(rs.m, id)
}

// claim takes the client_stream id for one call on driver, waiting up to
// wait for it to be opened.
func (rs *resources) claim(ctx context.Context, id, driver string, wait time.Duration) (*clientStream, error) {
	t := time.NewTimer(wait)
	defer t.Stop()
	for {
		rs.mu.Lock()
		c, ok := rs.m[id]
		ch := rs.changed
		if ok {
			defer rs.mu.Unlock()
			switch {
			case c.driver != driver:
				return nil, fmt.Errorf("%w: resource %s was opened for another driver", ErrInvalidArgument, id)
			case c.claimed:
				return nil, fmt.Errorf("%w: resource %s is already used by another call (a handle serves one call)", ErrInvalidArgument, id)
			}
			c.claimed = true
			return c, nil
		}
		rs.mu.Unlock()
		select {
		case <-ch:
		case <-t.C:
			return nil, fmt.Errorf("resource %s never came: no resource stream with that uuid was open on this exporter within %s (it ended, or was opened on another exporter): %w", id, wait, context.DeadlineExceeded)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// newUUID is a random (version 4) UUID in canonical lowercase form.
func newUUID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = (b[6] & 0x0f) | 0x40
	b[8] = (b[8] & 0x3f) | 0x80
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// resourceStream serves a Stream of kind "resource": it opens a
// client_stream for the driver req names, answers its handle in the
// initial metadata and keeps the stream until the call that claimed it is
// done or the client ends it.
func (s *server) resourceStream(st pb.RouterService_StreamServer, req streamRequest) error {
	ctx := st.Context()
	d, err := s.lookup(req.UUID)
	if err != nil {
		return err
	}
	enc := ""
	if req.ContentEncoding != nil && acceptedEncodings[*req.ContentEncoding] {
		enc = *req.ContentEncoding
	}
	c := &clientStream{id: newUUID(), driver: d.uuid, enc: enc, release: make(chan struct{})}
	handle := map[string]any{"kind": "client_stream", "uuid": c.id, "x_jmp_content_encoding": nil}
	md := metadata.MD{}
	if enc != "" {
		handle["x_jmp_content_encoding"] = enc
		md.Set("x_jmp_accept_encoding", enc)
	}
	hb, _ := json.Marshal(handle)
	md.Set("resource", string(hb))
	c.conn = streamconn.New(streamconn.Pooled(streamconn.ServerFrames(st)), nil, "resource:"+c.id)
	s.e.res.add(c)
	defer s.e.res.remove(c.id)
	if o := s.e.cfg.Observer; o != nil {
		o.StreamOpened("resource")
		defer o.StreamClosed("resource")
	}
	// The client waits for the headers before it sends a byte.
	if err := st.SendHeader(md); err != nil {
		return err
	}
	s.e.log.V(1).Info("resource stream open", "driver", d.name, "resource", c.id, "encoding", enc)
	select {
	case <-c.release:
	case <-ctx.Done():
	}
	// GOAWAY, unless a stalled dump still holds the stream's writer: then
	// returning ends the stream, which ends that write.
	closed := make(chan struct{})
	go func() {
		_ = c.conn.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(time.Second):
	}
	return nil
}

// resourceHandle is a Resource (upstream's discriminated union).
type resourceHandle struct {
	Kind            string            `json:"kind"`
	UUID            string            `json:"uuid"`
	ContentEncoding *string           `json:"x_jmp_content_encoding"`
	URL             string            `json:"url"`
	Method          string            `json:"method"`
	Headers         map[string]string `json:"headers"`
}

// parseHandle reads a call's resource argument (a JSON object).
func parseHandle(v any) (resourceHandle, error) {
	var h resourceHandle
	m, ok := v.(map[string]any)
	if !ok {
		return h, fmt.Errorf("%w: a resource handle (a client_stream or presigned_request object) is expected, got %s", ErrInvalidArgument, describeArg(v))
	}
	b, _ := json.Marshal(m)
	if err := json.Unmarshal(b, &h); err != nil {
		return h, fmt.Errorf("%w: resource handle: %v", ErrInvalidArgument, err)
	}
	switch h.Kind {
	case "client_stream":
		id, ok := canonicalUUID(h.UUID)
		if !ok {
			return h, fmt.Errorf("%w: client_stream handle: uuid %q is not a UUID", ErrInvalidArgument, h.UUID)
		}
		h.UUID = id
	case "presigned_request":
		if h.Method != http.MethodGet && h.Method != http.MethodPut {
			return h, fmt.Errorf("%w: presigned_request handle: method %q (GET or PUT)", ErrInvalidArgument, h.Method)
		}
		u, err := url.Parse(h.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return h, fmt.Errorf("%w: presigned_request handle: url %q is not an http(s) URL", ErrInvalidArgument, redactURL(h.URL))
		}
	default:
		return h, fmt.Errorf("%w: resource handle kind %q (client_stream or presigned_request)", ErrInvalidArgument, h.Kind)
	}
	return h, nil
}

// openSource opens a resource for reading (flash): the bytes the client
// sends, decoded from the stream's content encoding. The reader returns
// io.EOF only when the resource ended cleanly; a broken, stalled or
// truncated transfer is an error naming what happened and after how many
// bytes.
func (s *server) openSource(ctx context.Context, d *driver, arg any) (io.ReadCloser, string, error) {
	h, err := parseHandle(arg)
	if err != nil {
		return nil, "", err
	}
	opts := s.e.cfg.Resources.withDefaults()
	if h.Kind == "presigned_request" {
		if h.Method != http.MethodGet {
			return nil, "", fmt.Errorf("%w: a presigned_request to read from must be a GET, got %s", ErrInvalidArgument, h.Method)
		}
		rc, err := fetch(ctx, h, opts)
		return rc, "presigned GET " + redactURL(h.URL), err
	}
	c, err := s.e.res.claim(ctx, h.UUID, d.uuid, opts.WaitTimeout)
	if err != nil {
		return nil, "", err
	}
	sr := &streamReader{c: c.conn, stall: opts.StallTimeout, total: opts.TransferTimeout}
	sr.deadline, _ = ctx.Deadline()
	var r io.Reader = sr
	what := "client stream " + c.id
	if c.enc != "" {
		dr, err := decoder(c.enc, r)
		if err != nil {
			c.done()
			return nil, "", fmt.Errorf("%s: %w", what, err)
		}
		r = dr
		what += " (" + c.enc + ")"
	}
	return &claimedReader{Reader: r, src: sr, c: c}, what, nil
}

type claimedReader struct {
	io.Reader
	src *streamReader
	c   *clientStream
}

func (r *claimedReader) failure() error { return r.src.failed }

func (r *claimedReader) Close() error {
	if cl, ok := r.Reader.(io.Closer); ok {
		_ = cl.Close()
	}
	r.c.done()
	return nil
}

// streamReader reads a client_stream with a stall deadline on every Read
// and the transfer's deadline (zero: none) over all of them.
type streamReader struct {
	c        *streamconn.Conn
	stall    time.Duration
	deadline time.Time
	total    time.Duration // what the deadline allows, for messages
	n        int64
	failed   error
}

func (r *streamReader) Read(p []byte) (int, error) {
	if r.failed != nil {
		return 0, r.failed
	}
	dl, whole := transferDeadline(r.stall, r.deadline)
	_ = r.c.SetReadDeadline(dl)
	n, err := r.c.Read(p)
	r.n += int64(n)
	switch {
	case err == nil || errors.Is(err, io.EOF):
		return n, err
	case errors.Is(err, os.ErrDeadlineExceeded) && whole:
		r.failed = &sourceError{tooLong(r.total, r.n)}
	case errors.Is(err, os.ErrDeadlineExceeded):
		r.failed = &sourceError{fmt.Errorf("the client sent nothing for %s (after %d bytes): %w", r.stall, r.n, context.DeadlineExceeded)}
	default:
		r.failed = &sourceError{fmt.Errorf("the client's resource stream ended abnormally after %d bytes: %w", r.n, streamErr(err))}
	}
	return n, r.failed
}

// transferDeadline is the deadline of the next read or write: stall from
// now, or the transfer's deadline when that comes first (whole).
func transferDeadline(stall time.Duration, deadline time.Time) (time.Time, bool) {
	dl := time.Now().Add(stall)
	if !deadline.IsZero() && deadline.Before(dl) {
		return deadline, true
	}
	return dl, false
}

// tooLong is the error of a transfer that outlived its time limit.
func tooLong(total time.Duration, n int64) error {
	return fmt.Errorf("the transfer did not end within %s, the node's limit for one transfer (after %d bytes): %w", total, n, context.DeadlineExceeded)
}

// streamErr says what a stream's error means without the gRPC wrapping.
func streamErr(err error) error {
	if st, ok := status.FromError(err); ok {
		switch st.Code() {
		case codes.Canceled:
			return errors.New("the client cancelled it")
		case codes.Unavailable:
			return fmt.Errorf("the connection to the client was lost (%s)", st.Message())
		}
		return errors.New(st.Message())
	}
	return err
}

// openSink opens a resource for writing (dump): Close completes the
// transfer (end of stream for a client_stream, the PUT's response for a
// presigned_request) and reports whether it arrived; Abort ends it with an
// error. size is the length to send (-1 unknown).
func (s *server) openSink(ctx context.Context, d *driver, arg any, size int64) (sink, string, error) {
	h, err := parseHandle(arg)
	if err != nil {
		return nil, "", err
	}
	opts := s.e.cfg.Resources.withDefaults()
	if h.Kind == "presigned_request" {
		if h.Method != http.MethodPut {
			return nil, "", fmt.Errorf("%w: a presigned_request to write to must be a PUT, got %s", ErrInvalidArgument, h.Method)
		}
		w, err := put(ctx, h, size, opts)
		return w, "presigned PUT " + redactURL(h.URL), err
	}
	c, err := s.e.res.claim(ctx, h.UUID, d.uuid, opts.WaitTimeout)
	if err != nil {
		return nil, "", err
	}
	w := &streamSink{c: c, stall: opts.StallTimeout}
	sw := &stallWriter{c: c, stall: opts.StallTimeout, total: opts.TransferTimeout}
	sw.deadline, _ = ctx.Deadline()
	w.w = io.Writer(sw)
	what := "client stream " + c.id
	if c.enc != "" {
		ew, err := encoder(c.enc, w.w)
		if err != nil {
			c.done()
			return nil, "", fmt.Errorf("%s: %w", what, err)
		}
		w.enc, w.w = ew, ew
		what += " (" + c.enc + ")"
	}
	return w, what, nil
}

// sink is where dump writes.
type sink interface {
	io.Writer
	Close() error
	Abort(err error)
}

// streamSink writes to a client_stream.
type streamSink struct {
	c     *clientStream
	w     io.Writer
	enc   io.WriteCloser // the encoder, when the stream has an encoding
	stall time.Duration
}

func (w *streamSink) Write(p []byte) (int, error) { return w.w.Write(p) }

func (w *streamSink) Close() error {
	defer w.c.done()
	if w.enc != nil {
		if err := w.enc.Close(); err != nil {
			return fmt.Errorf("finish %s encoding: %w", w.c.enc, err)
		}
	}
	if err := w.c.conn.CloseWrite(); err != nil {
		return fmt.Errorf("end the resource stream: %w", streamErr(err))
	}
	return nil
}

func (w *streamSink) Abort(error) {
	w.c.done() // the stream ends without GOAWAY: the handler returns
}

// stallWriter fails a Write the client does not take within stall (flow
// control holds Send while the client reads nothing).
type stallWriter struct {
	c        *clientStream
	stall    time.Duration
	deadline time.Time
	total    time.Duration
	n        int64
}

func (w *stallWriter) Write(p []byte) (int, error) {
	dl, whole := transferDeadline(w.stall, w.deadline)
	t := time.AfterFunc(time.Until(dl), w.c.done) // the handler returns: the stream ends
	n, err := w.c.conn.Write(p)
	stalled := !t.Stop()
	w.n += int64(n)
	if err != nil {
		if stalled && whole {
			return n, tooLong(w.total, w.n)
		}
		if stalled {
			return n, fmt.Errorf("the client took nothing for %s (after %d bytes): %w", w.stall, w.n, context.DeadlineExceeded)
		}
		return n, fmt.Errorf("the client's resource stream ended abnormally after %d bytes: %w", w.n, streamErr(err))
	}
	return n, nil
}

// ---- presigned requests ----

// sensitiveHeaderPrefixes are dropped when a redirect leaves the origin
// (upstream's _strip_sensitive_headers).
var sensitiveHeaderPrefixes = []string{"authorization", "cookie", "proxy-authorization", "x-amz-", "x-ms-", "x-goog-"}

// redactURL drops the query (presigned signatures) from a URL for messages.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "<unparsable URL>"
	}
	if u.RawQuery != "" {
		u.RawQuery = "[REDACTED]"
	}
	u.User = nil
	return u.String()
}

// httpClient is the client presigned requests use: no proxy from the
// environment, redirects (at most 10, http or https) drop credentials
// across origins, and every connection, a redirect's too, dials only
// where the fetch policy allows (the check is on the address dialled, so
// DNS cannot route around it).
func httpClient(opts ResourceOptions) *http.Client {
	dialer := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	dial := dialer.DialContext
	if !opts.AllowLocalFetch {
		dial = opts.Fetch.dialContext(dialer)
	}
	tr := &http.Transport{
		DialContext:           dial,
		ForceAttemptHTTP2:     true,
		TLSHandshakeTimeout:   30 * time.Second,
		ResponseHeaderTimeout: 2 * time.Minute,
		DisableCompression:    true, // the bytes as served: compression is detected by signature
	}
	return &http.Client{Transport: tr, CheckRedirect: func(req *http.Request, via []*http.Request) error {
		if len(via) > 10 {
			return fmt.Errorf("too many redirects (10)")
		}
		if req.URL.Scheme != "http" && req.URL.Scheme != "https" {
			return fmt.Errorf("%w: a redirect to %s (http or https only)", ErrInvalidArgument, redactURL(req.URL.String()))
		}
		prev := via[len(via)-1].URL
		if prev.Scheme != req.URL.Scheme || prev.Host != req.URL.Host {
			for k := range req.Header {
				lk := strings.ToLower(k)
				for _, p := range sensitiveHeaderPrefixes {
					if strings.HasPrefix(lk, p) {
						req.Header.Del(k)
						break
					}
				}
			}
		}
		return nil
	}}
}

// fetch GETs a presigned_request; the body is read with a stall watchdog
// and the whole transfer is bounded by ctx (the transfer's deadline).
func fetch(ctx context.Context, h resourceHandle, opts ResourceOptions) (io.ReadCloser, error) {
	ctx, cancel := context.WithCancel(ctx)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, h.URL, nil)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("%w: presigned GET %s: %v", ErrInvalidArgument, redactURL(h.URL), err)
	}
	for k, v := range h.Headers {
		req.Header.Set(k, v)
	}
	resp, err := httpClient(opts).Do(req)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("presigned GET %s failed: %w", redactURL(h.URL), requestErr(err, h.URL))
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		resp.Body.Close()
		cancel()
		return nil, fmt.Errorf("presigned GET %s failed: status %s", redactURL(h.URL), resp.Status)
	}
	return &bodyReader{ctx: ctx, body: resp.Body, cancel: cancel, stall: opts.StallTimeout, total: opts.TransferTimeout, url: h.URL}, nil
}

// requestErr is the error of an HTTP request without the URL's query:
// a refusal of the fetch policy as itself (ErrInvalidArgument), any other
// as its redacted message.
func requestErr(err error, raw string) error {
	var refused *RefusedError
	switch {
	case errors.As(err, &refused):
		return refused
	case errors.Is(err, ErrInvalidArgument):
		return invalidArg(redactErr(err, raw))
	}
	return errors.New(redactErr(err, raw))
}

// invalidArg is an ErrInvalidArgument with a message of its own.
type invalidArg string

func (e invalidArg) Error() string { return string(e) }
func (e invalidArg) Unwrap() error { return ErrInvalidArgument }

// redactErr is err's message without the URL's query.
func redactErr(err error, raw string) string {
	msg := err.Error()
	if u, perr := url.Parse(raw); perr == nil && u.RawQuery != "" {
		msg = strings.ReplaceAll(msg, raw, redactURL(raw))
		msg = strings.ReplaceAll(msg, u.RawQuery, "[REDACTED]")
	}
	return msg
}

// bodyReader reads an HTTP body; a Read that waits longer than stall
// cancels the request.
type bodyReader struct {
	ctx    context.Context // the request's: its deadline is the transfer's
	total  time.Duration
	body   io.ReadCloser
	cancel context.CancelFunc
	stall  time.Duration
	url    string
	n      int64
	failed error
}

func (r *bodyReader) failure() error { return r.failed }

func (r *bodyReader) Read(p []byte) (int, error) {
	if r.failed != nil {
		return 0, r.failed
	}
	t := time.AfterFunc(r.stall, r.cancel)
	n, err := r.body.Read(p)
	stalled := !t.Stop()
	r.n += int64(n)
	if err != nil && !errors.Is(err, io.EOF) {
		switch {
		case stalled:
			r.failed = &sourceError{fmt.Errorf("presigned GET %s sent nothing for %s (after %d bytes): %w", redactURL(r.url), r.stall, r.n, context.DeadlineExceeded)}
		case errors.Is(r.ctx.Err(), context.DeadlineExceeded):
			r.failed = &sourceError{fmt.Errorf("presigned GET %s: %w", redactURL(r.url), tooLong(r.total, r.n))}
		default:
			r.failed = &sourceError{fmt.Errorf("presigned GET %s broke after %d bytes: %s", redactURL(r.url), r.n, redactErr(err, r.url))}
		}
		return n, r.failed
	}
	return n, err
}

func (r *bodyReader) Close() error {
	err := r.body.Close()
	r.cancel()
	return err
}

// putSink streams a dump into a presigned PUT.
type putSink struct {
	pw     *io.PipeWriter
	resp   chan error
	cancel context.CancelFunc
	url    string
	once   sync.Once
	err    error // the request's outcome, once resp gave it
}

// result waits for the request's outcome.
func (w *putSink) result() error {
	w.once.Do(func() { w.err = <-w.resp })
	return w.err
}

func put(ctx context.Context, h resourceHandle, size int64, opts ResourceOptions) (sink, error) {
	ctx, cancel := context.WithCancel(ctx)
	pr, pw := io.Pipe()
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, h.URL, pr)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("%w: presigned PUT %s: %v", ErrInvalidArgument, redactURL(h.URL), err)
	}
	if size >= 0 {
		req.ContentLength = size
	}
	for k, v := range h.Headers {
		req.Header.Set(k, v)
	}
	w := &putSink{pw: pw, resp: make(chan error, 1), cancel: cancel, url: h.URL}
	go func() {
		resp, err := httpClient(opts).Do(req)
		if err != nil {
			err = fmt.Errorf("presigned PUT %s failed: %w", redactURL(h.URL), requestErr(err, h.URL))
			pr.CloseWithError(err)
			w.resp <- err
			return
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode > 299 {
			err = fmt.Errorf("presigned PUT %s failed: status %s", redactURL(h.URL), resp.Status)
			pr.CloseWithError(err)
		}
		w.resp <- err
	}()
	return w, nil
}

// Write sends p; once the request stopped taking the body, its error
// says why.
func (w *putSink) Write(p []byte) (int, error) {
	n, err := w.pw.Write(p)
	if err != nil {
		if rerr := w.result(); rerr != nil {
			return n, rerr
		}
	}
	return n, err
}

func (w *putSink) Close() error {
	_ = w.pw.Close()
	err := w.result()
	w.cancel()
	return err
}

func (w *putSink) Abort(err error) {
	w.pw.CloseWithError(err)
	w.cancel()
	_ = w.result()
}
