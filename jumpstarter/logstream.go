package jumpstarter

import (
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/emptypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/qemu-kubelet/qemu-kubelet/jumpstarter/pb"
)

// Severities of log lines, Python's level names as upstream's exporter
// sends them (the client maps them to its logging levels).
const (
	SeverityDebug   = "DEBUG"
	SeverityInfo    = "INFO"
	SeverityWarning = "WARNING"
	SeverityError   = "ERROR"
)

// LogEntry is one line of the exporter's log for a client: what the
// driver is doing (pulling, flashing, powering) or what the exporter
// itself does (lease begins, ends). Never put secrets in one.
type LogEntry struct {
	// Severity is one of the Severity* names ("" means INFO).
	Severity string
	Message  string
	// Driver is the driver the line is about ("power", "flasher"...), ""
	// for the exporter's own lines (source SYSTEM rather than DRIVER).
	Driver string
	// Operation names the operation the line belongs to ("flash",
	// "power on"...), optional.
	Operation string
	// Time defaults to when the line is added.
	Time time.Time
}

// LogBookSize is how many lines a LogBook keeps for streams not open yet
// (upstream's session queue holds 256).
const LogBookSize = 256

// LogBook holds the log lines of one target for LogStream. The owner of
// the target makes one, writes to it from its Target methods and passes it
// in Config.Logs; the exporter adds its own lines. Safe for concurrent use.
//
// As upstream's session queue: lines from the lease's start on are kept
// (the last LogBookSize) until a LogStream takes them; a line goes out
// once, to every stream open when it is added, and a stream opened later
// gets the kept lines no stream has taken yet (a reconnecting client sees
// no line twice).
type LogBook struct {
	mu        sync.Mutex
	ring      []LogEntry // ring[i] has sequence number first+i
	first     uint64
	delivered uint64        // lines before this were sent to some stream
	wake      chan struct{} // closed (and replaced) by add
}

// NewLogBook returns an empty book.
func NewLogBook() *LogBook {
	return &LogBook{wake: make(chan struct{})}
}

// Add appends a line.
func (b *LogBook) Add(e LogEntry) {
	if b == nil {
		return
	}
	if e.Time.IsZero() {
		e.Time = time.Now()
	}
	if e.Severity == "" {
		e.Severity = SeverityInfo
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.ring = append(b.ring, e)
	if len(b.ring) > LogBookSize {
		drop := len(b.ring) - LogBookSize
		b.ring = append(b.ring[:0:0], b.ring[drop:]...)
		b.first += uint64(drop)
	}
	close(b.wake)
	b.wake = make(chan struct{})
}

// Printf adds a line for driver at severity.
func (b *LogBook) Printf(driver, severity, format string, args ...any) {
	b.Add(LogEntry{Driver: driver, Severity: severity, Message: fmt.Sprintf(format, args...)})
}

// beginLease drops the lines of before the lease: a new session's streams
// start with its own lines, as upstream's per-session queue does.
func (b *LogBook) beginLease() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.first += uint64(len(b.ring))
	b.ring = nil
	b.delivered = b.first
}

// cursor is where a new stream starts: the first line no stream took.
func (b *LogBook) cursor() uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return max(b.delivered, b.first)
}

// since returns the lines from seq on, the sequence after them and a
// channel closed when more come; the lines count as delivered.
func (b *LogBook) since(seq uint64) ([]LogEntry, uint64, <-chan struct{}) {
	b.mu.Lock()
	defer b.mu.Unlock()
	seq = max(seq, b.first)
	end := b.first + uint64(len(b.ring))
	out := append([]LogEntry(nil), b.ring[seq-b.first:]...)
	b.delivered = max(b.delivered, end)
	return out, end, b.wake
}

// response is the LogStreamResponse of e, in upstream's shape: uuid empty
// (upstream's handler sets none), severity the level name, source SYSTEM
// for the exporter's own lines and DRIVER (with driver_type) for a
// driver's, the entry's timestamp.
func (e LogEntry) response() *pb.LogStreamResponse {
	r := &pb.LogStreamResponse{Severity: e.Severity, Message: e.Message, Timestamp: timestamppb.New(e.Time)}
	src := pb.LogSource_LOG_SOURCE_SYSTEM
	if e.Driver != "" {
		src = pb.LogSource_LOG_SOURCE_DRIVER
		d := e.Driver
		r.DriverType = &d
	}
	r.Source = &src
	if e.Operation != "" {
		op := e.Operation
		r.Operation = &op
	}
	return r
}

// LogStream sends the target's log lines (LogBook) until the client ends
// the stream.
func (s *server) LogStream(_ *emptypb.Empty, st pb.ExporterService_LogStreamServer) error {
	b := s.e.logs
	ctx := st.Context()
	seq := b.cursor()
	// Headers at once: a client that waits for them knows its stream gets
	// every line added from now on.
	if err := st.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	for {
		lines, next, wake := b.since(seq)
		for _, l := range lines {
			if err := st.Send(l.response()); err != nil {
				return err
			}
		}
		seq = next
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		}
	}
}
