package e2e

import (
	"context"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
)

// createRecorder records the distinct pods (by UID) that appear with
// app=<set> while a test runs, from one watch: for each its name, creation
// time, the test step active when it was first seen, and what it was last
// seen as (phase and container state, lease labels, when it was deleted
// and the step then). When a count is off, report says which step made
// each pod and how it ended.
type createRecorder struct {
	mu    sync.Mutex
	step  string
	pods  map[types.UID]*recordedPod
	ended bool // the watch closed before the test ended: later pods are missing
}

// recordedPod is what a createRecorder saw of one pod.
type recordedPod struct {
	name    string
	created time.Time
	step    string // active when the pod was first seen
	last    string // phase/state and lease labels of its last event
	deleted string // step active when its deletion was first seen ("" if not seen)
}

// recordCreates starts recording set's pods until t ends.
func (e *exsEnv) recordCreates(t *testing.T, set string) *createRecorder {
	t.Helper()
	r := &createRecorder{step: "start", pods: map[types.UID]*recordedPod{}}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	w, err := e.c.Client().CoreV1().Pods(e.ns).Watch(ctx, metav1.ListOptions{LabelSelector: "app=" + set})
	require.NoError(t, err)
	go func() {
		defer w.Stop()
		for ev := range w.ResultChan() {
			if p, ok := ev.Object.(*corev1.Pod); ok && ev.Type != watch.Error {
				r.saw(p, ev.Type == watch.Deleted)
			}
		}
		r.mu.Lock()
		r.ended = ctx.Err() == nil
		r.mu.Unlock()
	}()
	return r
}

// setStep names the test step from now on (what report attributes pods to).
func (r *createRecorder) setStep(step string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.step = step
}

func (r *createRecorder) saw(p *corev1.Pod, gone bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	rp := r.pods[p.UID]
	if rp == nil {
		rp = &recordedPod{name: p.Name, created: p.CreationTimestamp.Time, step: r.step}
		r.pods[p.UID] = rp
	}
	rp.last = podTag(p)
	if podReady(p) {
		rp.last += " Ready"
	}
	if p.Status.Reason != "" {
		rp.last += " reason=" + p.Status.Reason
	}
	for _, l := range []string{v1alpha1.LeaseLabel, v1alpha1.UsedLabel} {
		if v, ok := p.Labels[l]; ok {
			rp.last += " " + l + "=" + v
		}
	}
	if (gone || p.DeletionTimestamp != nil) && rp.deleted == "" {
		rp.deleted = r.step
	}
}

func (r *createRecorder) uids() []types.UID {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []types.UID
	for uid := range r.pods {
		out = append(out, uid)
	}
	return out
}

// times returns the pods' creation timestamps, sorted.
func (r *createRecorder) times() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []time.Time
	for _, p := range r.pods {
		out = append(out, p.created)
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

func (r *createRecorder) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pods)
}

func (r *createRecorder) names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for uid, p := range r.pods {
		out = append(out, fmt.Sprintf("%s(%s)", p.name, uid))
	}
	return out
}

// report is one line per pod, in order of creation: name, UID, creation
// time, the step it was first seen in, the step its deletion was seen in,
// and its last state.
func (r *createRecorder) report() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	uids := make([]types.UID, 0, len(r.pods))
	for uid := range r.pods {
		uids = append(uids, uid)
	}
	slices.SortFunc(uids, func(a, b types.UID) int {
		if c := r.pods[a].created.Compare(r.pods[b].created); c != 0 {
			return c
		}
		return strings.Compare(r.pods[a].name, r.pods[b].name)
	})
	var b strings.Builder
	for _, uid := range uids {
		p := r.pods[uid]
		deleted := "-"
		if p.deleted != "" {
			deleted = p.deleted
		}
		fmt.Fprintf(&b, "  %s %s created %s in step %q, deleted in step %q, last: %s\n",
			p.name, uid, p.created.UTC().Format(time.TimeOnly), p.step, deleted, p.last)
	}
	if r.ended {
		b.WriteString("  (the watch closed early: pods created later are missing)\n")
	}
	return b.String()
}

// logSetHistory writes what explains a set's pod count: the pods the
// recorder saw, the set's events (SuccessfulCreate and SuccessfulDelete
// name the pods and why) and the controller's log lines about the set that
// acted (a plan that created or deleted, the pods it created, conflicts,
// requeues, errors).
func (e *exsEnv) logSetHistory(t *testing.T, set string, r *createRecorder) {
	t.Helper()
	t.Logf("exporterset %s: pods seen (%d):\n%s", set, r.count(), r.report())
	t.Logf("exporterset %s: events:\n%s", set, e.setEvents(set))
	t.Logf("exporterset %s: controller log lines that acted:\n%s", set, actingLogLines(e.ctrlLog, set, 120))
}

// setEvents lists the events regarding ExporterSet set, oldest first.
func (e *exsEnv) setEvents(set string) string {
	l, err := e.c.Client().CoreV1().Events(e.ns).List(context.Background(), metav1.ListOptions{
		FieldSelector: "involvedObject.kind=ExporterSet,involvedObject.name=" + set})
	if err != nil {
		return "  list events: " + err.Error()
	}
	at := func(ev corev1.Event) time.Time {
		if !ev.EventTime.IsZero() {
			return ev.EventTime.Time
		}
		return ev.CreationTimestamp.Time
	}
	slices.SortStableFunc(l.Items, func(a, b corev1.Event) int { return at(a).Compare(at(b)) })
	var b strings.Builder
	for _, ev := range l.Items {
		// The recorder folds events of one reason about one version of the
		// set (one reconcile's batches) into a series: one note, a count.
		folded := ""
		if ev.Series != nil {
			folded = fmt.Sprintf(" (x%d, one note kept)", ev.Series.Count)
		}
		fmt.Fprintf(&b, "  %s %s %s: %s%s\n", at(ev).UTC().Format("15:04:05.000"), ev.Type, ev.Reason, ev.Message, folded)
	}
	return b.String()
}

// idlePlan matches a controller "plan" log line that changed nothing.
var idlePlan = regexp.MustCompile(`"plan".* create=0 delete=0 clearUsed=0 expireLease=0 markUsed=0 `)

// actingLogLines returns the last max lines of the controller log at path
// about set (name="set") except plans that changed nothing.
func actingLogLines(path, set string, max int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return "  read controller log: " + err.Error()
	}
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, `name="`+set+`"`) && !idlePlan.MatchString(l) {
			out = append(out, "  "+l)
		}
	}
	if len(out) > max {
		out = append([]string{fmt.Sprintf("  (%d earlier lines left out)", len(out)-max)}, out[len(out)-max:]...)
	}
	return strings.Join(out, "\n")
}
