package bench

import (
	"fmt"
	"io"
	"os"

	"github.com/schollz/progressbar/v3"
	"golang.org/x/term"
)

// progress reports a benchmark's advance: a bar when w is a terminal, and
// otherwise a plain line at every tenth of the way, so that logs and pipes
// never fill with carriage returns. A nil *progress does nothing.
type progress struct {
	bar         *progressbar.ProgressBar
	w           io.Writer
	desc        string
	total, done int
	lastTenth   int
}

func newProgress(w io.Writer, total int, desc string) *progress {
	if w == nil || total <= 0 {
		return nil
	}
	p := &progress{w: w, desc: desc, total: total}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(desc),
			progressbar.OptionClearOnFinish())
	}
	return p
}

// Add records n more steps done.
func (p *progress) Add(n int) {
	if p == nil {
		return
	}
	p.done += n
	if p.bar != nil {
		_ = p.bar.Add(n)
		return
	}
	if tenth := 10 * p.done / p.total; tenth > p.lastTenth {
		p.lastTenth = tenth
		fmt.Fprintf(p.w, "%s: %d/%d\n", p.desc, p.done, p.total)
	}
}
