package jstest

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/internal/streamconn"
	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Client is a Jumpstarter client (what `jmp`/`j` do, in Go): it dials a
// lease through the controller and speaks to the exporter through the
// router.
type Client struct {
	endpoint        string
	token           string
	namespace, name string
	creds           credentials.TransportCredentials
	// DialTimeout bounds Dial's retries while the exporter is not ready or
	// not listening (upstream's client: 60 s).
	DialTimeout time.Duration
}

// NewClient returns a client of the controller at endpoint (TLS verified
// against caPEM, system roots when empty; plaintext when insecure).
func NewClient(endpoint, token, namespace, name string, caPEM []byte, insec bool) (*Client, error) {
	var creds credentials.TransportCredentials
	if insec {
		creds = insecure.NewCredentials()
	} else {
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if len(caPEM) > 0 {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(caPEM) {
				return nil, errors.New("jstest client: CA bundle holds no PEM certificate")
			}
			tc.RootCAs = pool
		}
		creds = credentials.NewTLS(tc)
	}
	return &Client{endpoint: endpoint, token: token, namespace: namespace, name: name, creds: creds, DialTimeout: 60 * time.Second}, nil
}

// NewClient adds a client ns/name to the controller and returns a Client
// for it.
func (c *Controller) NewClient(ns, name string) *Client {
	tok := c.AddClient(ns, name, "")
	cl, err := NewClient(c.Endpoint(), tok, ns, name, c.CABundle(), c.Insecure())
	if err != nil {
		panic(err) // the controller's own CA always parses
	}
	return cl
}

func (cl *Client) withAuth(ctx context.Context, token string) context.Context {
	return metadata.AppendToOutgoingContext(ctx,
		"authorization", "Bearer "+token,
		"jumpstarter-kind", "Client",
		"jumpstarter-namespace", cl.namespace,
		"jumpstarter-name", cl.name)
}

// DialToken asks the controller for a router stream of the lease, retrying
// (like upstream's client) while the exporter is not ready
// (FailedPrecondition "not ready") or not listening (Unavailable).
func (cl *Client) DialToken(ctx context.Context, lease string) (*pb.DialResponse, error) {
	conn, err := grpc.NewClient(cl.endpoint, grpc.WithTransportCredentials(cl.creds))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctl := pb.NewControllerServiceClient(conn)
	ctx, cancel := context.WithTimeout(ctx, cl.DialTimeout)
	defer cancel()
	delay := 10 * time.Millisecond
	for {
		resp, err := ctl.Dial(cl.withAuth(ctx, cl.token), &pb.DialRequest{LeaseName: lease})
		if err == nil {
			return resp, nil
		}
		code := status.Code(err)
		retry := code == codes.Unavailable || (code == codes.FailedPrecondition && strings.Contains(status.Convert(err).Message(), "not ready"))
		if !retry || ctx.Err() != nil {
			return nil, fmt.Errorf("dial lease %s: %w", lease, err)
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("dial lease %s: %w (last: %v)", lease, ctx.Err(), err)
		case <-time.After(delay):
		}
		delay = min(2*delay, 500*time.Millisecond)
	}
}

// Session is one gRPC connection to the exporter through the router.
type Session struct {
	router *grpc.ClientConn
	conn   *grpc.ClientConn
	// Exporter and Router are the raw stubs (for calls the helpers lack).
	Exporter pb.ExporterServiceClient
	Router   pb.RouterServiceClient
}

// ClientFrame is the most bytes upstream's Python client puts in one
// router frame: its gRPC connection to the exporter travels through a
// local socket read in 64 KiB chunks (anyio's default receive size) and
// files go up a resource stream in 64 KiB reads.
const ClientFrame = 64 << 10

// Dial gets a router token for the lease and opens a gRPC connection to
// the exporter through the router (one token, one connection).
func (cl *Client) Dial(ctx context.Context, lease string) (*Session, error) {
	resp, err := cl.DialToken(ctx, lease)
	if err != nil {
		return nil, err
	}
	return cl.Connect(ctx, resp.GetRouterEndpoint(), resp.GetRouterToken())
}

// Connect opens the gRPC connection to the exporter through the router
// with a token from DialToken.
func (cl *Client) Connect(ctx context.Context, routerEndpoint, token string) (*Session, error) {
	// The frames' codec and buffer pool keep this in-process client's cost
	// per frame near what upstream's (C-core) client spends, not gRPC-Go's
	// default (a cleared megabyte per 64 KiB frame).
	codec := grpc.WithDefaultCallOptions(grpc.ForceCodecV2(streamconn.Codec))
	router, err := grpc.NewClient(routerEndpoint, grpc.WithTransportCredentials(cl.creds), experimental.WithBufferPool(streamconn.BufferPool), codec)
	if err != nil {
		return nil, err
	}
	var once sync.Once
	dialer := func(context.Context, string) (net.Conn, error) {
		var c net.Conn
		err := errors.New("the router token was used already (one token, one connection)")
		once.Do(func() {
			sctx, cancel := context.WithCancel(context.Background())
			sctx = metadata.AppendToOutgoingContext(sctx, "authorization", "Bearer "+token)
			st, serr := pb.NewRouterServiceClient(router).Stream(sctx)
			if serr != nil {
				cancel()
				err = serr
				return
			}
			sc := streamconn.New(streamconn.ClientFrames(st), cancel, "router:"+routerEndpoint)
			sc.SetMaxFrame(ClientFrame)
			c, err = sc, nil
		})
		return c, err
	}
	conn, err := grpc.NewClient("passthrough:///jumpstarter-exporter",
		grpc.WithContextDialer(dialer), grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithWriteBufferSize(1<<20), grpc.WithReadBufferSize(1<<20),
		grpc.WithInitialWindowSize(4<<20), grpc.WithInitialConnWindowSize(8<<20),
		experimental.WithBufferPool(streamconn.BufferPool), codec)
	if err != nil {
		router.Close()
		return nil, err
	}
	conn.Connect()
	return &Session{router: router, conn: conn, Exporter: pb.NewExporterServiceClient(conn), Router: pb.NewRouterServiceClient(conn)}, nil
}

// Close ends the connection (and its router stream).
func (s *Session) Close() error {
	err := s.conn.Close()
	s.router.Close()
	return err
}

// GetReport is ExporterService.GetReport.
func (s *Session) GetReport(ctx context.Context) (*pb.GetReportResponse, error) {
	return s.Exporter.GetReport(ctx, &emptypb.Empty{})
}

// GetStatus is ExporterService.GetStatus.
func (s *Session) GetStatus(ctx context.Context) (*pb.GetStatusResponse, error) {
	return s.Exporter.GetStatus(ctx, &pb.GetStatusRequest{})
}

func encodeArgs(args []any) ([]*structpb.Value, error) {
	out := make([]*structpb.Value, len(args))
	for i, a := range args {
		v, err := structpb.NewValue(a)
		if err != nil {
			return nil, fmt.Errorf("argument %d: %w", i, err)
		}
		out[i] = v
	}
	return out, nil
}

// Call is a DriverCall; args and the result in their JSON form (nil,
// bool, float64, string, []any, map[string]any).
func (s *Session) Call(ctx context.Context, uuid, method string, args ...any) (any, error) {
	vs, err := encodeArgs(args)
	if err != nil {
		return nil, err
	}
	resp, err := s.Exporter.DriverCall(ctx, &pb.DriverCallRequest{Uuid: uuid, Method: method, Args: vs})
	if err != nil {
		return nil, err
	}
	return resp.GetResult().AsInterface(), nil
}

// StreamingCall is a StreamingDriverCall: each result goes to each (an
// error from each ends the call).
func (s *Session) StreamingCall(ctx context.Context, uuid, method string, args []any, each func(any) error) error {
	vs, err := encodeArgs(args)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := s.Exporter.StreamingDriverCall(ctx, &pb.StreamingDriverCallRequest{Uuid: uuid, Method: method, Args: vs})
	if err != nil {
		return err
	}
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := each(m.GetResult().AsInterface()); err != nil {
			return err
		}
	}
}

// Stream opens a byte stream to a driver method (e.g. "connect" of a
// NetworkClient driver), as upstream's DriverClient.stream: the `request`
// metadata names it, the response headers confirm it. Close sends GOAWAY;
// CloseWrite (on the returned *streamconn.Conn, via interface) half-closes.
func (s *Session) Stream(ctx context.Context, uuid, method string) (io.ReadWriteCloser, error) {
	req, _ := json.Marshal(map[string]string{"kind": "driver", "uuid": uuid, "method": method})
	sctx, cancel := context.WithCancel(context.Background())
	sctx = metadata.AppendToOutgoingContext(sctx, "request", string(req))
	stop := context.AfterFunc(ctx, cancel) // ctx bounds the opening only
	st, err := s.Router.Stream(sctx)
	if err == nil {
		var md metadata.MD
		md, err = st.Header()
		if err == nil && md == nil {
			// Ended without headers: the status tells why.
			if _, err = st.Recv(); errors.Is(err, io.EOF) || err == nil {
				err = errors.New("the exporter ended the stream without headers")
			}
		}
	}
	stop()
	if err != nil {
		cancel()
		return nil, err
	}
	return streamconn.New(streamconn.ClientFrames(st), cancel, "driver:"+uuid), nil
}

// FindDriver returns the report of the child named name ("" is the root).
func FindDriver(rep *pb.GetReportResponse, name string) (*pb.DriverInstanceReport, bool) {
	for _, r := range rep.GetReports() {
		if name == "" && r.ParentUuid == nil {
			return r, true
		}
		if name != "" && r.GetLabels()["jumpstarter.dev/name"] == name {
			return r, true
		}
	}
	return nil, false
}
