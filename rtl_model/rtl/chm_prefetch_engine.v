// chm_prefetch_engine: explicit staging of objects, issue -> wait -> release.
//
// Decisions are those of the reference model emulator/prefetch.py::PrefetchEngine:
// a prefetch of PAGES pages from FIRST_PAGE under a host-chosen HANDLE is
// accepted only if the handle is not in use (else EINVAL), the object can ever
// fit the window (else EINVAL), a handle slot is free (else EBUSY) and the pages
// fit the window beside those already held (else EBUSY). Accepted objects have
// their page fetches issued to the SSD side in acceptance order, one page per
// cycle, each into a staging frame taken from a free list (lowest free frame).
// Completions come back in any order, naming the staging frame; when the last
// page of an object arrives its handle goes out on the ready stream. RELEASE
// frees the object's frames and slot (EINVAL for an unknown or already
// released handle).
//
// Where the RTL is stricter than the reference: a RELEASE of an object whose
// pages have not all arrived is refused with EBUSY (its frames are still
// being written by the SSD side); PAGES = 0 is refused with EINVAL.
//
// Timing: commands one at a time; status 2 cycles after a command is accepted
// (S_IDLE accept, S_EXEC decide, S_STATUS hold). Fetch requests: one page per
// cycle from the cycle after acceptance, independent of the command path.
//
// Parameters
//   WINDOW_PAGES  staging frames (the bounded window, in pages), >= 2, < 2**PAGES_W
//   MAX_HANDLES   objects outstanding at once (power of two, >= 2)
//   HANDLE_W      handle width;  ADDR_W  page-address width;  PAGES_W  object-size width
//   FAULT         test-only fault injection: 0 none; 1 an object that would fill
//                 the window exactly is refused with EBUSY (off-by-one)
//
// Ports (valid/ready streams; a beat moves when valid && ready at a clock edge)
//   clk, rst                 clock, synchronous active-high reset
//   command stream (in)
//     cmd_valid, cmd_ready   1, 1
//     cmd_op       2         0 ISSUE, 1 RELEASE, 2 QUERY (is the object staged?)
//     cmd_handle   HANDLE_W  the object's handle (given by the host)
//     cmd_page     ADDR_W    ISSUE: first page of the object
//     cmd_pages    PAGES_W   ISSUE: pages in the object
//   status stream (out), one per command, in order
//     sts_valid, sts_ready   1, 1
//     sts_code     8         0 ok, 16 EBUSY (window or handles full; release before staged),
//                            22 EINVAL (handle in use / unknown, size never fits)
//     sts_handle   HANDLE_W  the command's handle
//     sts_staged   1         QUERY/RELEASE ok: every page of the object has arrived
//   fetch-request stream to the SSD side (out), in issue order
//     fq_valid, fq_ready     1, 1
//     fq_handle    HANDLE_W  object the page belongs to
//     fq_page      ADDR_W    device page to read
//     fq_frame     FRAME_W   staging frame to read it into
//   completion stream from the SSD side (in), any order
//     cpl_valid, cpl_ready   1, 1
//     cpl_frame    FRAME_W   staging frame whose page has arrived
//   ready stream (out): objects in the order they became fully staged
//     rdy_valid, rdy_ready   1, 1
//     rdy_handle   HANDLE_W

`resetall
`timescale 1ns / 1ps
`default_nettype none

module chm_prefetch_engine #(
    parameter integer WINDOW_PAGES = 16,
    parameter integer MAX_HANDLES = 4,
    parameter integer HANDLE_W = 16,
    parameter integer ADDR_W = 32,
    parameter integer PAGES_W = 8,
    parameter integer FAULT = 0,
    // derived, do not override
    parameter integer FRAME_W = $clog2(WINDOW_PAGES)
) (
    input  wire                clk,
    input  wire                rst,

    input  wire                cmd_valid,
    output wire                cmd_ready,
    input  wire [1:0]          cmd_op,
    input  wire [HANDLE_W-1:0] cmd_handle,
    input  wire [ADDR_W-1:0]   cmd_page,
    input  wire [PAGES_W-1:0]  cmd_pages,

    output reg                 sts_valid,
    input  wire                sts_ready,
    output reg  [7:0]          sts_code,
    output reg  [HANDLE_W-1:0] sts_handle,
    output reg                 sts_staged,

    output reg                 fq_valid,
    input  wire                fq_ready,
    output reg  [HANDLE_W-1:0] fq_handle,
    output reg  [ADDR_W-1:0]   fq_page,
    output reg  [FRAME_W-1:0]  fq_frame,

    input  wire                cpl_valid,
    output wire                cpl_ready,
    input  wire [FRAME_W-1:0]  cpl_frame,

    output reg                 rdy_valid,
    input  wire                rdy_ready,
    output reg  [HANDLE_W-1:0] rdy_handle
);

localparam integer SLOT_W = $clog2(MAX_HANDLES);
localparam integer HELD_W = $clog2(WINDOW_PAGES + 1);
localparam integer CW = (PAGES_W > HELD_W ? PAGES_W : HELD_W) + 1;  // page arithmetic width
localparam [CW-1:0] WINDOW = WINDOW_PAGES[CW-1:0];

localparam [1:0] OP_ISSUE = 2'd0, OP_RELEASE = 2'd1, OP_QUERY = 2'd2;
localparam [7:0] OK = 8'd0, EBUSY = 8'd16, EINVAL = 8'd22;  // Linux errno values
localparam [1:0] S_IDLE = 2'd0, S_EXEC = 2'd1, S_STATUS = 2'd2;

initial begin
    if (WINDOW_PAGES < 2 || WINDOW_PAGES >= (1 << PAGES_W) || ADDR_W <= PAGES_W || MAX_HANDLES < 2
            || (MAX_HANDLES & (MAX_HANDLES - 1)) != 0) begin
        $error("chm_prefetch_engine: WINDOW_PAGES=%0d must be in [2, 2**PAGES_W), MAX_HANDLES=%0d a power of two >= 2",
               WINDOW_PAGES, MAX_HANDLES);
        $finish;
    end
end

// object slots
reg                s_valid   [0:MAX_HANDLES-1];
reg [HANDLE_W-1:0] s_handle  [0:MAX_HANDLES-1];
reg [ADDR_W-1:0]   s_page    [0:MAX_HANDLES-1];
reg [PAGES_W-1:0]  s_pages   [0:MAX_HANDLES-1];
reg [PAGES_W-1:0]  s_issued  [0:MAX_HANDLES-1];
reg [PAGES_W-1:0]  s_arrived [0:MAX_HANDLES-1];
// staging frames: free list as a used bitmap, and the owning slot
reg                f_used [0:WINDOW_PAGES-1];
reg [SLOT_W-1:0]   f_slot [0:WINDOW_PAGES-1];
reg [CW-1:0]       held;      // pages reserved by accepted objects
// slots waiting for their fetches to be issued, in acceptance order
reg [SLOT_W-1:0]   order [0:MAX_HANDLES-1];
reg [SLOT_W:0]     order_rd, order_wr;

// the command being served
reg [1:0]          state;
reg [1:0]          q_op;
reg [HANDLE_W-1:0] q_handle;
reg [ADDR_W-1:0]   q_page;
reg [PAGES_W-1:0]  q_pages;

assign cmd_ready = state == S_IDLE;
assign cpl_ready = !rdy_valid || rdy_ready;

// ---- command decision (combinational) ----
reg               match;
reg [SLOT_W-1:0]  match_slot;
reg               slot_free;
reg [SLOT_W-1:0]  free_slot;
integer s;
always @* begin
    match = 1'b0; match_slot = {SLOT_W{1'b0}};
    slot_free = 1'b0; free_slot = {SLOT_W{1'b0}};
    for (s = MAX_HANDLES - 1; s >= 0; s = s - 1) begin
        if (s_valid[s] && s_handle[s] == q_handle) begin
            match = 1'b1; match_slot = s[SLOT_W-1:0];
        end
        if (!s_valid[s]) begin
            slot_free = 1'b1; free_slot = s[SLOT_W-1:0];
        end
    end
end

wire [CW-1:0] req_pages = {{(CW - PAGES_W){1'b0}}, q_pages};
wire [CW-1:0] held_after = held + req_pages;
wire          window_full = FAULT == 1 ? held_after >= WINDOW : held_after > WINDOW;
wire          staged = s_arrived[match_slot] == s_pages[match_slot];

reg [7:0] code;
always @* begin
    code = OK;
    case (q_op)
        OP_ISSUE:
            if (match || req_pages > WINDOW || q_pages == {PAGES_W{1'b0}}) code = EINVAL;
            else if (!slot_free || window_full) code = EBUSY;
        OP_RELEASE:
            if (!match) code = EINVAL;
            else if (!staged) code = EBUSY;
        OP_QUERY:
            if (!match) code = EINVAL;
        default: code = EINVAL;
    endcase
end

wire [CW-1:0] rel_pages = {{(CW - PAGES_W){1'b0}}, s_pages[match_slot]};
wire do_issue = state == S_EXEC && q_op == OP_ISSUE && code == OK;
wire do_release = state == S_EXEC && q_op == OP_RELEASE && code == OK;

// ---- fetch issue: head of the order queue, lowest free frame ----
reg               frame_free;
reg [FRAME_W-1:0] free_frame;
integer f;
always @* begin
    frame_free = 1'b0; free_frame = {FRAME_W{1'b0}};
    for (f = WINDOW_PAGES - 1; f >= 0; f = f - 1) begin
        if (!f_used[f]) begin
            frame_free = 1'b1; free_frame = f[FRAME_W-1:0];
        end
    end
end

wire [SLOT_W-1:0] head = order[order_rd[SLOT_W-1:0]];
wire              order_empty = order_rd == order_wr;
wire              fq_load = (!fq_valid || fq_ready) && !order_empty && frame_free;
wire [PAGES_W-1:0] head_issued_next = s_issued[head] + 1'b1;

// ---- completions ----
wire              cpl_fire = cpl_valid && cpl_ready && f_used[cpl_frame];
wire [SLOT_W-1:0] cpl_slot = f_slot[cpl_frame];
wire [PAGES_W-1:0] cpl_arrived_next = s_arrived[cpl_slot] + 1'b1;

integer i;
always @(posedge clk) begin
    // command path
    case (state)
        S_IDLE: if (cmd_valid) begin
            q_op <= cmd_op;
            q_handle <= cmd_handle;
            q_page <= cmd_page;
            q_pages <= cmd_pages;
            state <= S_EXEC;
        end
        S_EXEC: begin
            sts_valid <= 1'b1;
            sts_code <= code;
            sts_handle <= q_handle;
            sts_staged <= match && staged;
            state <= S_STATUS;
        end
        default: if (sts_ready) begin  // S_STATUS
            sts_valid <= 1'b0;
            state <= S_IDLE;
        end
    endcase

    if (do_issue) begin
        s_valid[free_slot] <= 1'b1;
        s_handle[free_slot] <= q_handle;
        s_page[free_slot] <= q_page;
        s_pages[free_slot] <= q_pages;
        s_issued[free_slot] <= {PAGES_W{1'b0}};
        s_arrived[free_slot] <= {PAGES_W{1'b0}};
        order[order_wr[SLOT_W-1:0]] <= free_slot;
        order_wr <= order_wr + 1'b1;
        held <= held_after;
    end
    if (do_release) begin
        s_valid[match_slot] <= 1'b0;
        held <= held - rel_pages;
    end

    // fetch path
    if (fq_load) begin
        fq_valid <= 1'b1;
        fq_handle <= s_handle[head];
        fq_page <= s_page[head] + {{(ADDR_W - PAGES_W){1'b0}}, s_issued[head]};
        fq_frame <= free_frame;
        s_issued[head] <= head_issued_next;
        if (head_issued_next == s_pages[head]) order_rd <= order_rd + 1'b1;
    end else if (fq_ready) begin
        fq_valid <= 1'b0;
    end
    for (i = 0; i < WINDOW_PAGES; i = i + 1) begin
        if (fq_load && free_frame == i[FRAME_W-1:0]) begin
            f_used[i] <= 1'b1;
            f_slot[i] <= head;
        end else if (do_release && f_used[i] && f_slot[i] == match_slot) begin
            f_used[i] <= 1'b0;
        end
    end

    // completion path
    if (cpl_fire) begin
        s_arrived[cpl_slot] <= cpl_arrived_next;
        if (cpl_arrived_next == s_pages[cpl_slot]) begin
            rdy_valid <= 1'b1;
            rdy_handle <= s_handle[cpl_slot];
        end else if (rdy_ready) begin
            rdy_valid <= 1'b0;
        end
    end else if (rdy_ready) begin
        rdy_valid <= 1'b0;
    end

    if (rst) begin
        state <= S_IDLE;
        sts_valid <= 1'b0;
        fq_valid <= 1'b0;
        rdy_valid <= 1'b0;
        held <= {CW{1'b0}};
        order_rd <= {(SLOT_W + 1){1'b0}};
        order_wr <= {(SLOT_W + 1){1'b0}};
        for (i = 0; i < MAX_HANDLES; i = i + 1) begin
            s_valid[i] <= 1'b0;
            s_pages[i] <= {PAGES_W{1'b0}};
            s_arrived[i] <= {PAGES_W{1'b0}};
        end
        for (i = 0; i < WINDOW_PAGES; i = i + 1) f_used[i] <= 1'b0;
    end
end

endmodule

`resetall
