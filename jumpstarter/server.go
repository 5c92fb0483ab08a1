package jumpstarter

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/internal/streamconn"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// sessionStatus is the exporter status GetStatus answers. The Run goroutine
// sets it on lease changes, EndSession sets AVAILABLE; the mutex makes
// GetStatus (any connection's goroutine) safe.
type sessionStatus struct {
	mu      sync.Mutex
	cur     pb.ExporterStatus
	prev    pb.ExporterStatus
	hasPrev bool
	msg     string
	version uint64
}

func (s *sessionStatus) set(st pb.ExporterStatus, msg string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == st && s.msg == msg {
		return
	}
	s.prev, s.hasPrev = s.cur, true
	s.cur, s.msg = st, msg
	s.version++
}

func (s *sessionStatus) get() pb.ExporterStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cur
}

func (s *sessionStatus) response() *pb.GetStatusResponse {
	s.mu.Lock()
	defer s.mu.Unlock()
	msg := s.msg
	r := &pb.GetStatusResponse{Status: s.cur, Message: &msg, StatusVersion: s.version}
	if s.hasPrev {
		p := s.prev
		r.PreviousStatus = &p
	}
	return r
}

// server serves ExporterService and RouterService.Stream on every client
// connection the router hands the exporter.
type server struct {
	pb.UnimplementedExporterServiceServer
	pb.UnimplementedRouterServiceServer
	e        *Exporter
	consoles consoles // open console streams (serial.go)
}

func (s *server) GetReport(context.Context, *emptypb.Empty) (*pb.GetReportResponse, error) {
	return &pb.GetReportResponse{Uuid: s.e.uuid, Labels: s.e.labels, Reports: s.e.reports()}, nil
}

func (s *server) GetStatus(context.Context, *pb.GetStatusRequest) (*pb.GetStatusResponse, error) {
	return s.e.status.response(), nil
}

func (s *server) EndSession(context.Context, *pb.EndSessionRequest) (*pb.EndSessionResponse, error) {
	s.e.status.set(pb.ExporterStatus_EXPORTER_STATUS_AVAILABLE, "Session ended by the client")
	select {
	case s.e.endSession <- struct{}{}:
	default: // one pending notice is enough
	}
	msg := "Session ended"
	return &pb.EndSessionResponse{Success: true, Message: &msg}, nil
}

func (s *server) Reset(context.Context, *pb.ResetRequest) (*pb.ResetResponse, error) {
	return &pb.ResetResponse{}, nil
}

// lookup finds the driver a request names.
func (s *server) lookup(id string) (*driver, error) {
	u, ok := canonicalUUID(id)
	if !ok {
		return nil, status.Errorf(codes.InvalidArgument, "driver uuid %q is not a UUID", id)
	}
	d, ok := s.e.byUUID[u]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no driver with uuid %s on this exporter", u)
	}
	return d, nil
}

// checkReady refuses driver calls outside a lease, as upstream's session does.
func (s *server) checkReady() error {
	if st := s.e.status.get(); st != pb.ExporterStatus_EXPORTER_STATUS_LEASE_READY {
		return status.Errorf(codes.FailedPrecondition, "Exporter not ready for driver calls (status: %s)", st)
	}
	return nil
}

func (s *server) observeCall(d *driver, method string, err error) {
	if o := s.e.cfg.Observer; o != nil {
		name := ""
		if d != nil {
			name = d.name
		}
		o.DriverCall(name, method, status.Code(err).String())
	}
}

func (s *server) DriverCall(ctx context.Context, req *pb.DriverCallRequest) (resp *pb.DriverCallResponse, err error) {
	var d *driver
	defer func() { s.observeCall(d, req.GetMethod(), err) }()
	if err := s.checkReady(); err != nil {
		return nil, err
	}
	d, err = s.lookup(req.GetUuid())
	if err != nil {
		return nil, err
	}
	args := decodeArgs(req.GetArgs())
	s.e.log.V(1).Info("driver call", "driver", d.name, "method", req.GetMethod())
	res, err := s.call(ctx, d, req.GetMethod(), args)
	if err != nil {
		return nil, grpcError(d, req.GetMethod(), err)
	}
	v, err := structpb.NewValue(res)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "%s.%s: encode result: %v", d.displayName(), req.GetMethod(), err)
	}
	return &pb.DriverCallResponse{Uuid: d.uuid, Result: v}, nil
}

func (s *server) StreamingDriverCall(req *pb.StreamingDriverCallRequest, st pb.ExporterService_StreamingDriverCallServer) (err error) {
	var d *driver
	defer func() { s.observeCall(d, req.GetMethod(), err) }()
	if err := s.checkReady(); err != nil {
		return err
	}
	d, err = s.lookup(req.GetUuid())
	if err != nil {
		return err
	}
	args := decodeArgs(req.GetArgs())
	s.e.log.V(1).Info("streaming driver call", "driver", d.name, "method", req.GetMethod())
	send := func(x any) error {
		v, err := structpb.NewValue(x)
		if err != nil {
			return status.Errorf(codes.Internal, "%s.%s: encode result: %v", d.displayName(), req.GetMethod(), err)
		}
		return st.Send(&pb.StreamingDriverCallResponse{Uuid: d.uuid, Result: v})
	}
	if err := s.streamingCall(st.Context(), d, req.GetMethod(), args, send); err != nil {
		return grpcError(d, req.GetMethod(), err)
	}
	return nil
}

func (d *driver) displayName() string {
	if d.name == "" {
		return "root"
	}
	return d.name
}

// methodNotFound is upstream's answer for a method a driver does not export.
func methodNotFound(d *driver, method string) error {
	return status.Errorf(codes.NotFound, "method %s not found on driver %s", method, d.displayName())
}

// call runs a unary driver method.
func (s *server) call(ctx context.Context, d *driver, method string, args []any) (any, error) {
	cfg := &s.e.cfg
	switch d.kind {
	case kindRoot:
		switch method {
		case "get_hostname":
			return cfg.Hostname, nil
		case "get_username":
			return cfg.Username, nil
		case "get_password":
			return cfg.Password, nil
		case "set_memory_size", "set_disk_size":
			return nil, s.resize(ctx, method, args) // resize.go
		}
	case kindPower:
		switch method {
		case "on":
			return nil, s.logged(DriverPower, "power on", "powering on", "powered on", func() error { return cfg.Target.PowerOn(ctx) })
		case "off":
			return nil, s.logged(DriverPower, "power off", "powering off", "powered off", func() error { return cfg.Target.PowerOff(ctx) })
		case "shutdown": // ours: the graceful off (target.go, Shutdowner)
			sd, ok := cfg.Target.(Shutdowner)
			if !ok {
				return nil, fmt.Errorf("%w: this target has no graceful power off (use off)", ErrUnsupported)
			}
			return nil, s.logged(DriverPower, "shutdown", "shutting down (ACPI power button)", "powered off", func() error { return sd.Shutdown(ctx) })
		case "rescue":
			return nil, fmt.Errorf("%w: a VM has no rescue mode (power off, flash, power on instead)", ErrUnsupported)
		}
	case kindFlasher:
		switch method {
		case "flash":
			// flash(source, partition): upstream's QemuFlasher hands oci://
			// sources to flash_oci; other sources are resource handles
			// (flasher.go).
			if src, ok := arg(args, 0).(string); ok {
				if !strings.HasPrefix(src, "oci://") {
					return nil, fmt.Errorf("%w: flash: source %s is neither a resource handle nor an oci:// reference", ErrInvalidArgument, describeArg(src))
				}
				return nil, s.flashOCI(ctx, []any{src, arg(args, 1)}, func(any) error { return nil })
			}
			return nil, s.flashResource(ctx, d, args)
		case "dump":
			return nil, s.dump(ctx, d, args)
		}
	case kindConsole:
		return s.serialCall(d, method, args)
	}
	return nil, methodNotFound(d, method)
}

// logged runs f with a LogStream line before and one after (the error's
// when it fails).
func (s *server) logged(driver, op, before, after string, f func() error) error {
	s.e.logs.Add(LogEntry{Driver: driver, Operation: op, Message: before})
	if err := f(); err != nil {
		s.e.logs.Add(LogEntry{Driver: driver, Operation: op, Severity: SeverityError, Message: op + " failed: " + err.Error()})
		return err
	}
	s.e.logs.Add(LogEntry{Driver: driver, Operation: op, Message: after})
	return nil
}

// streamingCall runs a streaming driver method, sending each result.
func (s *server) streamingCall(ctx context.Context, d *driver, method string, args []any, send func(any) error) error {
	switch {
	case d.kind == kindPower && method == "read":
		return fmt.Errorf("%w: power read: a VM has no power meter (upstream's QemuPower does not measure either)", ErrUnsupported)
	case d.kind == kindFlasher && method == "flash_oci":
		return s.flashOCI(ctx, args, send)
	}
	return methodNotFound(d, method)
}

// flashOCI is upstream's flash_oci(oci_url, partition, oci_username,
// oci_password): it yields (stdout, stderr, returncode) tuples, returncode
// null until the end, then ("", "", 0).
func (s *server) flashOCI(ctx context.Context, args []any, send func(any) error) error {
	url, ok := arg(args, 0).(string)
	if !ok || !strings.HasPrefix(url, "oci://") {
		return fmt.Errorf("%w: OCI URL must start with oci://, got: %s", ErrInvalidArgument, describeArg(arg(args, 0)))
	}
	part := PartitionRoot
	if p := arg(args, 1); p != nil && p != "" {
		var err error
		if part, err = partitionArg(p); err != nil {
			return err
		}
	}
	creds, err := flashCredentials(args) // flashauth.go
	if err != nil {
		return err
	}
	ref := strings.TrimPrefix(url, "oci://")
	if ref == "" {
		return fmt.Errorf("%w: OCI URL %q names no image", ErrInvalidArgument, url)
	}
	flash, err := s.e.ociFlash(ctx, OCIFlash{Ref: ref, Partition: part, Credentials: creds}) // flashauth.go
	if err != nil {
		return err
	}
	s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "flash", Message: "flashing " + ref})

	// Target.Flash calls progress from its own goroutine(s); one goroutine
	// (this one) sends on the stream.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	lines := make(chan string, 16)
	done := make(chan error, 1)
	progress := func(line string) {
		s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "flash", Message: line})
		select {
		case lines <- line:
		case <-ctx.Done():
		}
	}
	go func() { done <- s.e.transfer(ctx, "flash", progress, flash) }() // limits.go
	for {
		select {
		case l := <-lines:
			if err := send([]any{l + "\n", "", nil}); err != nil {
				cancel()
				<-done
				return err
			}
		case err := <-done:
			for drained := false; !drained; {
				select {
				case l := <-lines:
					if serr := send([]any{l + "\n", "", nil}); serr != nil {
						return serr
					}
				default:
					drained = true
				}
			}
			if err != nil {
				s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "flash", Severity: SeverityError, Message: "flash of " + ref + " failed: " + err.Error()})
				return err
			}
			s.e.logs.Add(LogEntry{Driver: DriverFlasher, Operation: "flash", Message: "flashed " + ref})
			return send([]any{"", "", 0})
		}
	}
}

func arg(args []any, i int) any {
	if i < len(args) {
		return args[i]
	}
	return nil
}

func describeArg(v any) string {
	if s, ok := v.(string); ok {
		return fmt.Sprintf("%q", s)
	}
	b, _ := json.Marshal(v)
	return string(b)
}

func decodeArgs(vs []*structpb.Value) []any {
	out := make([]any, len(vs))
	for i, v := range vs {
		out[i] = v.AsInterface()
	}
	return out
}

// grpcError maps a driver error to a gRPC status the way upstream's
// drivers do (ValueError -> InvalidArgument, NotImplementedError ->
// Unimplemented, timeouts -> DeadlineExceeded, anything else -> Unknown).
func grpcError(d *driver, method string, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	msg := fmt.Sprintf("%s.%s: %v", d.displayName(), method, err)
	switch {
	case errors.Is(err, ErrInvalidArgument):
		return status.Error(codes.InvalidArgument, msg)
	case errors.Is(err, ErrUnsupported):
		return status.Error(codes.Unimplemented, msg)
	case errors.Is(err, context.DeadlineExceeded):
		return status.Error(codes.DeadlineExceeded, msg)
	case errors.Is(err, context.Canceled):
		return status.Error(codes.Canceled, msg)
	}
	return status.Error(codes.Unknown, msg)
}

// streamRequest is the `request` metadata of a byte stream (upstream's
// DriverStreamRequest / ResourceStreamRequest, pydantic JSON).
type streamRequest struct {
	Kind            string  `json:"kind"`
	UUID            string  `json:"uuid"`
	Method          string  `json:"method"`
	ContentEncoding *string `json:"x_jmp_content_encoding"` // kind resource
}

// Stream serves a byte stream to a driver (the console or a guest port)
// or a resource (resource.go).
func (s *server) Stream(st pb.RouterService_StreamServer) error {
	ctx := st.Context()
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("request")
	if len(vals) != 1 {
		return status.Error(codes.InvalidArgument, "byte stream: exactly one `request` metadata entry expected")
	}
	var req streamRequest
	if err := json.Unmarshal([]byte(vals[0]), &req); err != nil {
		return status.Errorf(codes.InvalidArgument, "byte stream: `request` metadata is not JSON: %v", err)
	}
	switch req.Kind {
	case "driver":
	case "resource":
		return s.resourceStream(st, req) // resource.go
	default:
		return status.Errorf(codes.InvalidArgument, "byte stream kind %q: want driver or resource", req.Kind)
	}
	d, err := s.lookup(req.UUID)
	if err != nil {
		return err
	}
	if req.Method != "connect" || (d.kind != kindConsole && d.kind != kindPort && d.kind != kindDisplay) {
		return status.Errorf(codes.NotFound, "method %s not found on driver %s", req.Method, d.displayName())
	}
	kind := "console"
	var res io.ReadWriteCloser
	switch d.kind {
	case kindConsole:
		// PySerial's close ends the stream (serial.go).
		var cancel context.CancelFunc
		ctx, cancel = context.WithCancel(ctx)
		defer cancel()
		defer s.consoles.add(cancel)()
		res, err = s.e.cfg.Target.Console(ctx)
	case kindDisplay:
		kind = "vnc"
		res, err = s.e.cfg.Target.(Displayer).Display(ctx) // New checked it
	default:
		kind = "tcp"
		res, err = s.e.cfg.Target.DialGuest(ctx, d.port)
	}
	if err != nil {
		return grpcError(d, req.Method, err)
	}
	defer res.Close()
	if o := s.e.cfg.Observer; o != nil {
		o.StreamOpened(kind)
		defer o.StreamClosed(kind)
	}
	// The Python client waits for the response headers before it sends.
	if err := st.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	conn := streamconn.New(streamconn.Pooled(streamconn.ServerFrames(st)), nil, "client")
	defer conn.Close()
	if err := pipe(ctx, conn, res, d.kind == kindConsole); err != nil {
		// No GOAWAY: the client reads the status, never a clean end.
		conn.Abort()
		s.e.log.V(1).Info("byte stream ended with an error", "driver", d.name, "err", err.Error())
		return grpcError(d, req.Method, err)
	}
	return nil
}

// pipe copies both ways between the client's stream and the resource until
// either side ends; the client's end of input half-closes a TCP resource
// (so a request/response protocol still gets its answer). A console has no
// end of input (upstream's serial port refuses one and its
// stream ends there), so the client's end of input ends its stream:
// PySerialClient.pexpect()'s port forward waits for that end before its
// session is over. A console that refuses the client's bytes (another
// party holds it, the VM stopped) is an error: the client must not read
// the clean end of stream that says its bytes were sent.
func pipe(ctx context.Context, c *streamconn.Conn, res io.ReadWriteCloser, console bool) error {
	fromRes := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, res)
		fromRes <- err
	}()
	fromClient := make(chan error, 1)
	toRes := &writeErr{w: res}
	go func() {
		_, err := io.Copy(toRes, c)
		fromClient <- err
	}()
	select {
	case <-ctx.Done():
		return nil
	case <-fromRes:
		return nil // resource ended: Close sends GOAWAY
	case <-fromClient:
		if console {
			if toRes.err != nil {
				return fmt.Errorf("the console refused the client's bytes, which were not sent: %w", toRes.err)
			}
			return nil
		}
		if cw, ok := res.(interface{ CloseWrite() error }); ok {
			_ = cw.CloseWrite()
			select {
			case <-fromRes:
			case <-ctx.Done():
			}
		}
		return nil
	}
}

// writeErr remembers the error of a Write to w (the resource), to tell it
// from the end of what the client sent. The one goroutine copying to w
// writes err; pipe reads it after that goroutine's result.
type writeErr struct {
	w   io.Writer
	err error
}

func (e *writeErr) Write(p []byte) (int, error) {
	n, err := e.w.Write(p)
	if err != nil {
		e.err = err
	}
	return n, err
}
